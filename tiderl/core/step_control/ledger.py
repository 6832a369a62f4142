"""The job's ledger: every step's :class:`StepRecord` and the totals they carry (trained tokens
and samples, the prefix-cache counters at the last record)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.buffer import ReadyBuffer
from tiderl.core.commands import StepOutcome
from tiderl.core.records import StepRecord
from tiderl.core.step_control.rollout import RolloutControl
from tiderl.core.step_control.state import CycleState, OpenStep


@dataclass
class Ledger:
    records: list[StepRecord] = field(default_factory=list)
    trained_tokens: int = 0
    trained_samples: int = 0
    kv_mark: tuple[int, int] = (0, 0)  # the prefix-cache counters (queries, hits) last recorded
    pause_mark: tuple[int, int] = (0, 0)  # CTB's (pauses, releases) last recorded
    reuse_mark: tuple[int, int] = (0, 0)  # rollout's (reused, reusable) tokens last recorded

    def record(self, current: OpenStep, outcome: StepOutcome, now: float, *, state: CycleState,
               rollout: RolloutControl, buffer: ReadyBuffer, tprm_s: float | None,
               num_rollout: int) -> StepRecord:
        """Step ``current`` trained: its record, kept, with the totals it adds."""
        self.trained_tokens += current.tokens
        self.trained_samples += current.samples
        start = current.start
        loss, grad_norm, loss_tokens = outcome.actor_figures(start.actor_ranks)
        twt = sum(r.wait_s for r in outcome.reports)
        twt += (current.opened_at - current.ready_at) * len(start.ranks)
        rwt, saturated, generating_share = rollout.interval()
        queries, hits = outcome.kv_queries - self.kv_mark[0], outcome.kv_hits - self.kv_mark[1]
        self.kv_mark = (outcome.kv_queries, outcome.kv_hits)
        pauses, releases = rollout.num_pauses, rollout.num_releases
        pause_mark, self.pause_mark = self.pause_mark, (pauses, releases)
        reused = rollout.reused_tokens - self.reuse_mark[0]
        reusable = rollout.reusable_tokens - self.reuse_mark[1]
        self.reuse_mark = (rollout.reused_tokens, rollout.reusable_tokens)
        record = StepRecord(
            step=start.step, start_s=current.opened_at - state.t0, end_s=now - state.t0,
            trained_tokens=current.tokens, trained_tokens_total=self.trained_tokens,
            trained_samples=current.samples,
            generated_tokens_total=rollout.generated_tokens,
            discarded_tokens_total=buffer.discarded.tokens, ras=current.ras,
            tprm_s=tprm_s, rwt_s=rwt, twt_s=twt, step_mode=start.step_mode,
            roles=tuple(role.value for role in state.roles),
            num_rollout=num_rollout, num_trainer=len(start.ranks),
            num_micro_batches=current.num_micro_batches,
            kv_hit_rate=hits / queries if queries > 0 else None,
            staleness_max=buffer.max_staleness_seen.get(start.step, 0),
            reward_mean=outcome.reward_mean, solved_frac=outcome.solved_frac,
            eval_reward=outcome.eval_reward,
            loss=loss, grad_norm=grad_norm, batch_size=current.samples,
            ers_reason=state.plan_reason.value if state.plan_reason is not None else None,
            trained_loss_tokens=loss_tokens, rollout_saturated_s=saturated,
            generating_share=generating_share, ctb_pauses=pauses - pause_mark[0],
            ctb_releases=releases - pause_mark[1], is_trained=outcome.is_trained,
            recorded_loss=outcome.recorded_loss,
            kv_retention=reused / reusable if reusable > 0 else None)
        self.records.append(record)
        return record
