"""Reading KV-cache usage and prefix hit rate out of a Prometheus text page: our engine's, our
coordinator's, vLLM's or SGLang's. Pure (no I/O): ``tiderl measure kv`` fetches, this parses.

Every metric name ``profile kv`` knows is in ``SOURCES`` of :mod:`tiderl.engine.metric_names`
(docs/monitoring.md lists them). A source has either counters of prompt tokens looked up /
found in the prefix cache (the hit rate is then a rate over the sampling interval) or only a
hit-rate gauge; and either a usage fraction or used/capacity token gauges. Several label sets of
one name (vLLM's ``engine``, our ``rank``) are summed, a fraction is averaged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tiderl.engine.metric_names import FRACTIONS, SOURCES
from tiderl.engine.prometheus import parse_prometheus


class KVSourceError(ValueError):
    """A page that is not Prometheus text, or names none of the known sources' metrics."""


@dataclass(frozen=True, slots=True)
class KVReading:
    """One scrape, in a source's own units (counters cumulative)."""

    source: str
    usage: float | None  # fraction 0..1
    used_tokens: float | None
    capacity_tokens: float | None
    queries: float | None
    hits: float | None
    hit_rate: float | None  # the source's gauge, when it has no counters


@dataclass(frozen=True, slots=True)
class KVSample:
    """One row of ``profile kv``: usage at ``t_s`` and the hit rate over the interval before."""

    t_s: float
    usage: float | None
    used_tokens: float | None
    capacity_tokens: float | None  # KV tokens the cache holds
    hit_rate: float | None
    hit_rate_kind: str  # "interval" (from counters) or "gauge"


def read_kv(text: str) -> KVReading:
    """One scrape, by the first of ``SOURCES`` whose names the page holds (a declared name
    without a sample, as on a coordinator before its first rank report, counts as present)."""
    try:
        values = parse_prometheus(text, FRACTIONS)
    except ValueError as exc:
        raise KVSourceError(str(exc)) from None
    source = next((s for s in SOURCES if s.matches(values)), None)
    if source is None:
        expected = "; ".join(s.key_names for s in SOURCES)
        raise KVSourceError(f"no KV-cache metrics found (expected {expected})")

    def get(name: str | None) -> float | None:
        value = values.get(name) if name else None
        return None if value is None or math.isnan(value) else value

    has_counters = get(source.queries) is not None and get(source.hits) is not None
    return KVReading(source.name, get(source.usage), get(source.used_tokens),
                     get(source.capacity_tokens), get(source.queries) if has_counters else None,
                     get(source.hits) if has_counters else None,
                     None if has_counters else get(source.hit_rate))


def kv_sample(t_s: float, before: KVReading, now: KVReading) -> KVSample:
    """The sample at ``now``; with counters, the hit rate of the lookups since ``before`` (None
    when there were none). A counter that went down (engine restart) counts from zero."""
    usage = now.usage
    if usage is None and now.used_tokens is not None and now.capacity_tokens:
        usage = now.used_tokens / now.capacity_tokens
    if now.queries is None or now.hits is None:
        return KVSample(t_s, usage, now.used_tokens, now.capacity_tokens, now.hit_rate, "gauge")
    restarted = before.queries is None or now.queries < before.queries
    d_queries = now.queries - (0.0 if restarted else before.queries)
    d_hits = now.hits - (0.0 if restarted else before.hits or 0.0)
    rate = d_hits / d_queries if d_queries > 0 else None
    return KVSample(t_s, usage, now.used_tokens, now.capacity_tokens, rate, "interval")
