"""The names under which each engine exports its KV cache, prefix cache and request counts:
one row per engine and naming. Every reader and writer of these names takes them from here:

    TIDERL_ENGINE       ──> tiderl/engine/server.py exports them
    TIDERL_COORDINATOR  ──> tiderl/runtime/prom.py exports them
    VLLM_NAMINGS, SGLANG_NAMINGS, TIDERL_ENGINE ──> the engine clients read /metrics by them
    SOURCES (every row)  ──> ``tiderl measure kv`` (tiderl/launch/kv_sources.py)

Counters are named without ``_total`` (exposition adds it; :mod:`tiderl.engine.prometheus`
drops it). docs/monitoring.md lists the rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class MetricNames:
    """One engine's names in one of its namings; None where it exports no such series."""

    name: str  # the row's, as ``profile kv`` reports it
    usage: str | None = None  # gauge, fraction of the KV cache in use (0..1)
    used_tokens: str | None = None  # gauge, KV tokens in use
    capacity_tokens: str | None = None  # gauge, KV tokens the cache holds
    queries: str | None = None  # counter, prompt tokens looked up in the prefix cache
    hits: str | None = None  # counter, of them found cached
    hit_rate: str | None = None  # gauge, for an engine without the two counters
    running: str | None = None  # gauge, requests running
    waiting: str | None = None  # gauge, requests waiting
    preemptions: str | None = None  # counter, requests preempted
    prefilled_tokens: str | None = None  # counter, prompt positions computed
    prefill_seconds: str | None = None  # counter, engine time spent computing them

    def matches(self, values: dict[str, float]) -> bool:
        """Whether a page's values hold this row's usage and hit rate (``profile kv``)."""
        has_usage = self.usage in values or (self.used_tokens in values
                                             and self.capacity_tokens in values)
        has_hits = (self.queries in values and self.hits in values) or self.hit_rate in values
        return has_usage and has_hits

    @property
    def key_names(self) -> str:
        """The names that identify this row, for the error on an unknown page."""
        usage = self.usage or f"{self.used_tokens}+{self.capacity_tokens}"
        hits = f"{self.queries}+{self.hits}" if self.queries else self.hit_rate
        return f"{usage} and {hits} ({self.name})"


TIDERL_ENGINE = MetricNames(
    "tiderl engine", usage="tiderl:kv_cache_usage_perc", queries="tiderl:prefix_cache_queries",
    hits="tiderl:prefix_cache_hits", running="tiderl:num_requests_running",
    waiting="tiderl:num_requests_waiting", preemptions="tiderl:num_preemptions",
    prefilled_tokens="tiderl:prompt_tokens_computed", prefill_seconds="tiderl:prefill_seconds")
TIDERL_COORDINATOR = MetricNames(
    "tiderl coordinator", used_tokens="tiderl_kv_tokens_used",
    capacity_tokens="tiderl_kv_tokens_capacity", hit_rate="tiderl_kv_hit_rate")

VLLM = MetricNames(
    "vllm", usage="vllm:kv_cache_usage_perc", queries="vllm:prefix_cache_queries",
    hits="vllm:prefix_cache_hits", running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting", preemptions="vllm:num_preemptions")
VLLM_GPU = replace(  # 0.7-0.8; 0.9+ still exports these deprecated names beside the new ones
    VLLM, name="vllm (0.7-0.8)", usage="vllm:gpu_cache_usage_perc",
    queries="vllm:gpu_prefix_cache_queries", hits="vllm:gpu_prefix_cache_hits")
VLLM_V0 = replace(VLLM_GPU, name="vllm (v0)", queries=None, hits=None,
                  hit_rate="vllm:gpu_prefix_cache_hit_rate")
VLLM_CACHE_CONFIG = "vllm:cache_config_info"  # info gauge: num_gpu_blocks, block_size labels

SGLANG = MetricNames(
    "sglang", usage="sglang:token_usage", used_tokens="sglang:num_used_tokens",
    capacity_tokens="sglang:max_total_num_tokens", hit_rate="sglang:cache_hit_rate",
    running="sglang:num_running_reqs", waiting="sglang:num_queue_reqs")
SGLANG_PRIORITY = "priority"  # label: "" on a total, a level on a per-level copy of it

# What each backend's client reads, newest naming first (a name absent from a page is looked
# up in the next row).
TIDERL_NAMINGS = (TIDERL_ENGINE,)
VLLM_NAMINGS = (VLLM, VLLM_GPU, VLLM_V0)
SGLANG_NAMINGS = (SGLANG,)

# ``profile kv``: the first row a page matches wins (so vLLM 0.9+ is read by its new names).
SOURCES = (TIDERL_ENGINE, TIDERL_COORDINATOR, VLLM, VLLM_GPU, VLLM_V0, SGLANG)

# Averaged over a name's label sets (per engine or rank) instead of summed.
FRACTIONS = frozenset(name for s in SOURCES for name in (s.usage, s.hit_rate) if name)
