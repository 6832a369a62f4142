"""Reading a Prometheus text page (an engine's ``/metrics``, our coordinator's): the one place
TideRL parses one, with ``prometheus_client.parser``. Pure (no I/O).

What the parser does with the names we read: ``:`` is a legal name character (``vllm:*``); a
counter's family is named without ``_total`` and its samples with it (an untyped sample keeps
the name it was written with); ``x_created`` is a family of its own; an info-style gauge
(``vllm:cache_config_info``) is a gauge like any other, its values in its labels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


def parse_prometheus(text: str, average: Collection[str] = (),
                     keep: Callable[[dict[str, str]], bool] | None = None) -> dict[str, float]:
    """{sample name: value}, a counter's without ``_total``; ``*_created`` is left out. The
    label sets of a name are summed (names in ``average``, such as a per-engine usage fraction,
    are averaged); ``keep`` picks the label sets (default: all). NaN samples are skipped, and a
    declared name with no sample of its own is NaN: present, value unknown.

    Raises ValueError ("not Prometheus text") on a page the parser refuses."""
    found: dict[str, list[float]] = {}
    for family in _families(text):
        found.setdefault(family.name.removesuffix("_total"), [])
        for sample in family.samples:
            if keep is None or keep(sample.labels):
                values = found.setdefault(sample.name.removesuffix("_total"), [])
                if not math.isnan(sample.value):
                    values.append(float(sample.value))
    return {name: _fold(values, name in average) for name, values in found.items()}


def info_labels(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of every sample of ``name`` (an info-style gauge whose labels carry the
    values)."""
    return [sample.labels for family in _families(text) for sample in family.samples
            if sample.name == name]


def _families(text: str) -> list[Metric]:
    """The page's metric families, but ``*_created`` (a counter's creation time)."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ValueError(f"not Prometheus text ({str(exc)[:80]!r})") from None
    return [family for family in families if not family.name.endswith("_created")]


def _fold(values: list[float], is_average: bool) -> float:
    if not values:
        return math.nan
    return sum(values) / len(values) if is_average else sum(values)
