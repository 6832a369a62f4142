"""The coordinator's Prometheus ``/metrics`` (what ``tiderl measure kv --job`` and a Prometheus
server scrape). Its own registry, fed plain values, so it is testable without a coordinator:

    Coordinator._publish      (every 0.5 s) ──update_live()──┐
    Coordinator._write_record (every step)  ──update_step()──┴─> registry ──> GET /metrics

Counters (``*_total``) only go up: the coordinator hands over its cumulative totals and the
exporter increments each counter by the difference. ``NaN`` in a gauge means "not known yet".
See docs/monitoring.md for every series.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from tiderl.core.system import StepMode
from tiderl.core.types import Role
from tiderl.engine.metric_names import TIDERL_COORDINATOR

STEP_MODES = tuple(mode.value for mode in StepMode)  # the step modes a metrics.jsonl record names
ROLES = tuple(role.value for role in Role)


class TotalCounter:
    """A counter fed cumulative totals: it goes up by the difference (never down)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.counter = Counter(name, documentation, registry=registry)
        self.total = 0.0

    def advance(self, total: float) -> None:
        if total > self.total:
            self.counter.inc(total - self.total)
            self.total = total


class RankGauge:
    """A gauge with one series per rollout rank: a rank no longer given loses its series."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.gauge = Gauge(name, documentation, ["rank"], registry=registry)
        self.ranks: set[str] = set()

    def set(self, values: Mapping[int, float]) -> None:
        ranks = {str(r): v for r, v in values.items()}
        for gone in self.ranks - set(ranks):
            self.gauge.remove(gone)
        for rank, value in ranks.items():
            self.gauge.labels(rank=rank).set(value)
        self.ranks = set(ranks)


class MetricsExporter:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.goodput_tokens = TotalCounter(
            "tiderl_goodput_tokens", "Goodput tokens: trained tokens of samples that were not "
            "discarded. In this runtime a sample is discarded (stale, dropped group) before it "
            "is trained, so this equals tiderl_trained_tokens_total.", registry=reg)
        self.trained_tokens = TotalCounter(
            "tiderl_trained_tokens", "Tokens of every sample consumed by an optimizer step.",
            registry=reg)
        self.rwt_seconds = TotalCounter(
            "tiderl_rwt_seconds", "Rollout wait time: rank-seconds rollout ranks sat idle "
            "while no task waited for admission (held back by the staleness bound).",
            registry=reg)
        self.twt_seconds = TotalCounter(
            "tiderl_twt_seconds", "Training wait time: rank-seconds trainer ranks waited for "
            "ready micro-batches, summed over finished steps.", registry=reg)
        self.ras = Gauge(
            "tiderl_ras", "Ready micro-batches in the global buffer now (the RAS of a step "
            "that would start now).", registry=reg)
        self.tprm_seconds = Gauge(
            "tiderl_tprm_seconds", "Mean interval between micro-batches that became ready "
            "after the current step started (NaN: fewer than two yet).", registry=reg)
        self.step_mode = Gauge(
            "tiderl_step_mode", "1 for the step mode of the last step, 0 for the others (all 0 "
            "before the first step).", ["step_mode"], registry=reg)
        self.ranks = Gauge("tiderl_ranks", "Ranks per role now.", ["role"], registry=reg)
        self.kv_hit_rate = Gauge(
            TIDERL_COORDINATOR.hit_rate, "Prefix-cache hit rate of the last step: prompt "
            "tokens found cached / looked up, over every rollout rank (NaN: no lookups).",
            registry=reg)
        self.staleness = Gauge(
            "tiderl_staleness", "Max staleness (version of the update minus the version that "
            "generated it) of the samples of the last step.", registry=reg)
        self.kv_tokens_used = RankGauge(
            TIDERL_COORDINATOR.used_tokens, "KV tokens in use on a rollout rank.", reg)
        self.kv_tokens_capacity = RankGauge(
            TIDERL_COORDINATOR.capacity_tokens,
            "KV tokens the engine cache of a rollout rank holds.", reg)
        self.ctb_budget_tokens = RankGauge(
            "tiderl_ctb_budget_tokens", "CTB's token budget B_r of a rollout rank: the KV "
            "tokens its admitted tasks may take.", reg)
        for mode in STEP_MODES:
            self.step_mode.labels(step_mode=mode).set(0)
        for role in ROLES:
            self.ranks.labels(role=role).set(0)
        self.tprm_seconds.set(math.nan)
        self.kv_hit_rate.set(math.nan)
        self._server: Any = None

    # ------------------------------------------------------------------ updates

    def update_step(self, *, trained_tokens_total: float, twt_s_total: float,
                    kv_hit_rate: float | None, staleness: float, step_mode: str) -> None:
        """After each step: cumulative totals, and the last step's hit rate, staleness, step
        mode."""
        self.trained_tokens.advance(trained_tokens_total)
        self.goodput_tokens.advance(trained_tokens_total)
        self.twt_seconds.advance(twt_s_total)
        self.kv_hit_rate.set(_or_nan(kv_hit_rate))
        self.staleness.set(staleness)
        for name in {*STEP_MODES, step_mode}:
            self.step_mode.labels(step_mode=name).set(1 if name == step_mode else 0)

    def update_live(self, *, rwt_s_total: float, ras: int, tprm_s: float | None,
                    roles: Sequence[str], kv_tokens: Mapping[int, tuple[int, int]],
                    ctb_budgets: Mapping[int, int]) -> None:
        """Every snapshot: RWT so far, the buffer's RAS/TPRM now, roles (one entry per rank),
        ``kv_tokens`` {rollout rank: (used, capacity)} and ``ctb_budgets`` {rollout rank: B_r};
        a rank missing from one loses that one's series."""
        self.rwt_seconds.advance(rwt_s_total)
        self.ras.set(ras)
        self.tprm_seconds.set(_or_nan(tprm_s))
        for role in {*ROLES, *roles}:
            self.ranks.labels(role=role).set(sum(1 for r in roles if r == role))
        self.kv_tokens_used.set({r: used for r, (used, _) in kv_tokens.items()})
        self.kv_tokens_capacity.set({r: capacity for r, (_, capacity) in kv_tokens.items()})
        self.ctb_budget_tokens.set(ctb_budgets)

    # ------------------------------------------------------------------ serving

    def start(self, host: str, port: int) -> None:
        """Serve ``GET /metrics`` on ``host:port`` from a daemon thread."""
        self._server, _thread = start_http_server(port, host, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else float(value)
