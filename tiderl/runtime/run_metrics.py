"""The coordinator's metrics half: RWT, the per-step record of ``metrics.jsonl``, the group
accounting, the PUB snapshots ``tiderl top`` reads and the Prometheus exporter's values
(:mod:`tiderl.runtime.prom`, when the daemon set ``self.exporter``). A mixin of
:class:`tiderl.runtime.coordinator.Coordinator`, whose state it reads.
"""

from __future__ import annotations

import json
import math

from tiderl.runtime import bus as b
from tiderl.runtime.records import StepRun


class MetricsMixin:
    def _group_accounting(self) -> dict[str, int]:
        """Every training group fed, by where it ended: trained, dropped, ready in the buffer
        (past the last step) or still rolling out."""
        buffered = {seq.seq_id.rsplit(".", 1)[0] for seq in self.mb_samples.values()}
        rolling = sum(1 for g in self.groups.values() if not g.is_eval)
        return {"fed": self.num_fed, "trained": len(self.trained_groups),
                "dropped": self.num_dropped_groups, "buffered": len(buffered),
                "rolling_out": rolling}

    def _integrate_rwt(self) -> None:
        """RWT as the simulator counts it: rollout ranks with no generation in flight while no
        task waits for admission (the staleness throttle holds rollout back), integrated over
        the coordinator's rounds. Idle time while tasks wait for their environment and new
        ones wait for KV budget is the scheduler's to fill, not a wait on the trainer."""
        now = self.now()
        elapsed, self._rwt_at = now - self._rwt_at, now
        if self.book.num_new > 0 or (self.is_sync and self.current is not None):
            return  # sync: rollout is parked while every rank trains (verl's phase)
        idle = sum(1 for r in self.rollout_ready
                   if not any(t.is_running for t in self.book.ranks[r].active.values()))
        self.rwt_s += elapsed * idle

    # ---------------------------------------------------------------- metrics

    def _counter_marks(self) -> dict[str, float]:
        queries = sum(m.prefix_queries for m in self.rank_metrics.values())
        hits = sum(m.prefix_hits for m in self.rank_metrics.values())
        return {"queries": queries, "hits": hits, "rwt": self.rwt_s}

    def _record(self, step: StepRun, now: float) -> dict:
        marks, self._marks = self._marks, self._counter_marks()
        d_queries = self._marks["queries"] - marks["queries"]
        tokens = sum(s.num_tokens for s in step.samples)
        self.trained_groups.update(s.seq_id.rsplit(".", 1)[0] for s in step.samples)
        self.trained_tokens += tokens
        self.trained_samples += len(step.samples)
        done = list(step.done.values())
        actor_done = [d for d in done if d.rank in step.actor_ranks]
        rewards = [self.rewards.pop(s.seq_id, 0.0) for s in step.samples]
        elapsed = now - self.t0
        twt = sum(d.stats.get("wait_s", 0.0) for d in done)
        twt += (step.start - step.ready_at) * len(step.ranks)
        eval_reward = None
        for eval_step in sorted(self.eval_done):
            eval_reward = self.eval_done.pop(eval_step)
        return {
            "step": step.step, "time_s": round(elapsed, 3), "step_s": round(now - step.start, 3),
            "goodput_tok_s": round(self.trained_tokens / elapsed, 2) if elapsed > 0 else 0.0,
            "trained_tokens": tokens, "trained_tokens_total": self.trained_tokens,
            "trained_samples": len(step.samples),
            "generated_tokens_total": self.generated_tokens,
            "discarded_tokens_total": self.buffer.discarded_tokens,
            "ras": step.ras, "tprm_s": _round(self.tracker.signals(now).tprm_s),
            "rwt_s": round(self._marks["rwt"] - marks["rwt"], 3),
            "twt_s": round(twt, 3), "mode": step.mode,
            "roles": [r.value for r in self.roles],
            "num_rollout": len(self._rollout_ranks()), "num_trainer": len(step.ranks),
            "num_micro_batches": step.num_mbs,
            "kv_hit_rate": _round((self._marks["hits"] - marks["hits"]) / d_queries)
            if d_queries > 0 else None,
            "staleness_max": max((step.step - s.version for s in step.samples), default=0),
            "reward_mean": round(sum(rewards) / len(rewards), 4) if rewards else 0.0,
            "solved_frac": round(sum(r >= 1.0 for r in rewards) / len(rewards), 4)
            if rewards else 0.0,
            "eval_reward": _round(eval_reward),
            "loss": _round(sum(d.loss for d in actor_done) / max(1, len(actor_done))),
            "grad_norm": _round(actor_done[0].grad_norm if actor_done else 0.0),
            "version": step.step + 1, "batch_size": len(step.samples),
            "ers_reason": self.last_plan_reason,
        }

    def _write_record(self, record: dict) -> None:
        if self.exporter is not None:  # first: once a step is in the file, /metrics has it
            self.exporter.update_step(
                trained_tokens_total=record["trained_tokens_total"],
                twt_s_total=sum(r["twt_s"] for r in self.records),  # record is in self.records
                kv_hit_rate=record["kv_hit_rate"], staleness=record["staleness_max"],
                mode=record["mode"])
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        self._publish(record)

    def _publish(self, record: dict | None = None) -> None:
        self._last_snapshot = self.now()
        last = record or (self.records[-1] if self.records else {})
        metrics = {k: float(v) for k, v in last.items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        metrics.update(steps=float(self.profile.runtime.steps), elapsed_s=self._elapsed(),
                       active=float(self.book.num_active), paused=float(self.book.num_paused),
                       new=float(self.book.num_new))
        self.server.publish(b.Snapshot(
            step=self.step, time=self._elapsed(),
            roles={r: role.value for r, role in enumerate(self.roles)},
            metrics=metrics, ranks=[self.rank_metrics[r] for r in sorted(self.rank_metrics)],
            mode=str(last.get("mode", "")), note=self.plan_note))
        if self.exporter is not None:
            self._export_live()

    def _export_live(self) -> None:
        signals = self.tracker.signals(self.now())
        rollout = set(self._rollout_ranks())
        self.exporter.update_live(
            rwt_s_total=self.rwt_s, ras=signals.ras, tprm_s=signals.tprm_s,
            roles=[role.value for role in self.roles],
            kv_tokens={r: (m.kv_tokens_used, m.kv_tokens_budget)
                       for r, m in self.rank_metrics.items() if r in rollout})


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None or math.isnan(value) else round(value, digits)
