"""What a client reads of an engine's state: :class:`ClientMetrics`, from the in-process engine's
counters or from a server's ``/metrics`` page by the backend's names (:mod:`.metric_names`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tiderl.engine.metric_names import VLLM_CACHE_CONFIG, MetricNames
from tiderl.engine.prometheus import info_labels


@dataclass(frozen=True, slots=True)
class ClientMetrics:
    """Engine state; counters in tokens. SGLang exports a hit rate, not hit/query counters."""

    prefix_cache_queries: float | None
    prefix_cache_hits: float | None
    kv_cache_usage_perc: float  # 0..1
    num_requests_running: float
    num_requests_waiting: float
    num_preemptions: float | None = None
    cache_hit_rate: float | None = None  # hits / queries (cumulative) or SGLang's gauge
    kv_capacity_tokens: float | None = None  # what the KV cache holds (vLLM, SGLang)
    prefill_tokens_per_s: float | None = None  # measured (ours); None: not measured


def hit_rate(hits: float | None, queries: float | None) -> float | None:
    return None if hits is None or not queries else hits / queries


def per_second(tokens: float | None, seconds: float | None) -> float | None:
    """A rate from a token counter and a seconds counter; None until both have counted."""
    return tokens / seconds if tokens and seconds else None


def vllm_kv_capacity(text: str) -> float | None:
    """``num_gpu_blocks × block_size`` from the labels of ``vllm:cache_config_info`` (summed
    over its engines), None where the page has no such gauge."""
    total = None
    for labels in info_labels(text, VLLM_CACHE_CONFIG):
        blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if blocks.isdigit() and size.isdigit():
            total = (total or 0.0) + int(blocks) * int(size)
    return total


def metrics_from_prometheus(values: dict[str, float],
                            namings: Sequence[MetricNames]) -> ClientMetrics:
    """A backend's values (:func:`~tiderl.engine.prometheus.parse_prometheus`) as ClientMetrics;
    each field by the first of the backend's ``namings`` whose name for it is on the page. The
    hit rate is hits / queries where the engine counts them, else its gauge."""

    def get(field: str) -> float | None:
        for names in namings:
            value = values.get(getattr(names, field) or "")
            if value is not None and not math.isnan(value):
                return value
        return None

    queries, hits = get("queries"), get("hits")
    rate = hit_rate(hits, queries) if queries is not None and hits is not None else get("hit_rate")
    return ClientMetrics(queries, hits, get("usage") or 0.0, get("running") or 0.0,
                         get("waiting") or 0.0, get("preemptions"), rate,
                         get("capacity_tokens"),
                         per_second(get("prefilled_tokens"), get("prefill_seconds")))
