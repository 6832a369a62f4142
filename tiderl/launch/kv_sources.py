"""Reading KV-cache usage and prefix hit rate out of a Prometheus text page: our engine's, our
coordinator's, vLLM's or SGLang's. Pure (no I/O): ``tiderl profile kv`` fetches, this parses.

Every metric name ``profile kv`` knows is in ``SOURCES`` (docs/monitoring.md lists them). A
source has either counters of prompt tokens looked up / found in the prefix cache (the hit rate
is then a rate over the sampling interval) or only a hit-rate gauge; and either a usage fraction
or used/capacity token gauges. Several label sets of one name (vLLM's ``engine``, our
``rank``) are summed, a fraction is averaged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class KVSource:
    name: str
    usage: str | None = None  # gauge, fraction of the KV cache in use (0..1)
    used_tokens: str | None = None  # gauge, KV tokens in use
    capacity_tokens: str | None = None  # gauge, KV tokens the cache holds
    queries: str | None = None  # counter, prompt tokens looked up in the prefix cache
    hits: str | None = None  # counter, of them found cached
    hit_rate: str | None = None  # gauge, used when there are no counters

    def matches(self, values: dict[str, float]) -> bool:
        has_usage = self.usage in values or (self.used_tokens in values
                                             and self.capacity_tokens in values)
        has_hits = (self.queries in values and self.hits in values) or self.hit_rate in values
        return has_usage and has_hits

    @property
    def key_names(self) -> str:
        """The names that identify this source, for the error on an unknown page."""
        usage = self.usage or f"{self.used_tokens}+{self.capacity_tokens}"
        hits = f"{self.queries}+{self.hits}" if self.queries else self.hit_rate
        return f"{usage} and {hits} ({self.name})"


# The first match wins: vLLM 0.9+ still exposes its deprecated gpu_* names beside the new ones.
SOURCES = (
    KVSource("tiderl engine", usage="tiderl:kv_cache_usage_perc",
             queries="tiderl:prefix_cache_queries", hits="tiderl:prefix_cache_hits"),
    KVSource("tiderl coordinator", used_tokens="tiderl_kv_tokens_used",
             capacity_tokens="tiderl_kv_tokens_capacity", hit_rate="tiderl_kv_hit_rate"),
    KVSource("vllm", usage="vllm:kv_cache_usage_perc", queries="vllm:prefix_cache_queries",
             hits="vllm:prefix_cache_hits"),
    KVSource("vllm (0.7-0.8)", usage="vllm:gpu_cache_usage_perc",
             queries="vllm:gpu_prefix_cache_queries", hits="vllm:gpu_prefix_cache_hits"),
    KVSource("vllm (v0)", usage="vllm:gpu_cache_usage_perc",
             hit_rate="vllm:gpu_prefix_cache_hit_rate"),
    KVSource("sglang", usage="sglang:token_usage", used_tokens="sglang:num_used_tokens",
             capacity_tokens="sglang:max_total_num_tokens", hit_rate="sglang:cache_hit_rate"),
)


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


def parse_values(text: str) -> dict[str, float]:
    """{metric name: value}, a counter under its name without ``_total``. The label sets of a
    name are summed (a fraction in ``SOURCES`` is averaged); NaN samples are skipped, and a
    name with no other sample (a family declared but empty) is NaN: present, value unknown."""
    sums: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            values = sums.setdefault(family.name.removesuffix("_total"), [])
            values += [s.value for s in family.samples  # not _created, _bucket, _sum, ...
                       if s.name in (family.name, f"{family.name}_total")
                       and not math.isnan(s.value)]
    except ValueError as exc:
        raise KVSourceError(f"not Prometheus text ({str(exc)[:80]!r})") from None
    return {name: _fold(name, values) for name, values in sums.items()}


def read_kv(text: str) -> KVReading:
    values = parse_values(text)
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


_FRACTIONS = {name for s in SOURCES for name in (s.usage, s.hit_rate) if name}


def _fold(name: str, values: list[float]) -> float:
    if not values:
        return math.nan
    return sum(values) / len(values) if name in _FRACTIONS else sum(values)
