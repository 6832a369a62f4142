"""The step controller: the step cycle of :mod:`tiderl.core.step_control` as one object.

Events in are its public methods (time is an argument); each returns the commands the adapter
applies, in order (:mod:`tiderl.core.commands`). Its phases are :class:`Phase`; the diagram and
the invariant are in the package docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from tiderl.core.buffer import ReadyBuffer, ReadyGroup
from tiderl.core.commands import (
    Abort,
    Boundary,
    CloseStep,
    Command,
    Dispatch,
    DropReason,
    FeedGroups,
    Finish,
    GroupDropped,
    GroupSpec,
    JoinRollout,
    LeaveRollout,
    ManualRequest,
    PlanRefused,
    RecordStep,
    Retire,
    StartStep,
    StepOutcome,
)
from tiderl.core.ctb import TaskBook
from tiderl.core.ers import ERSPolicy
from tiderl.core.readiness import ReadinessTracker
from tiderl.core.records import StepRecord
from tiderl.core.step_control.config import StepControlConfig, StepControlError
from tiderl.core.step_control.faults import RankFaults
from tiderl.core.step_control.inputs import (
    MeasuredPasses,
    choose_step_mode,
    ers_input,
    learn_passes,
)
from tiderl.core.step_control.manual import ManualPlans, planned_roles
from tiderl.core.step_control.rollout import RolloutControl
from tiderl.core.step_control.state import Evaluation, GroupCount, OpenStep, PendingBoundary, Phase
from tiderl.core.system import StepMode, SystemSpec
from tiderl.core.types import (
    Decision,
    Group,
    MicroBatch,
    Mode,
    PlanReason,
    ReadinessSignals,
    Role,
    RoleChange,
    ScalingPlan,
)


class StepController(ManualPlans, RankFaults):
    """See the module docstring. ``source`` turns a :class:`GroupSpec` into the group's tasks
    (the adapter's dataset: environment and seed of each task)."""

    def __init__(self, config: StepControlConfig, roles: list[Role],
                 source: Callable[[GroupSpec], Group], now: float = 0.0) -> None:
        self.config, self.source = config, source
        system = config.system
        self.roles = list(roles)
        self.dead: set[int] = set()
        self.max_staleness = system.max_staleness(config.max_staleness)
        self.batch_ideal = config.ers.batch_ideal
        ctb = config.ctb if system.uses_ctb else replace(config.ctb, policy="request")
        self.rollout = RolloutControl.of(ctb, budget=config.rank_budget,
                                         max_new_tokens=config.max_new_tokens,
                                         max_staleness=self.max_staleness,
                                         tasks_per_step=self.batch_ideal, now=now)
        self.policy = self.rollout.policy
        self.tracker = ReadinessTracker(now)
        self.buffer: ReadyBuffer = ReadyBuffer(
            self.tracker, group_size=config.group_size, batch_ideal=self.batch_ideal,
            max_staleness=self.max_staleness, tokens_per_rank=config.ra2p.tokens_per_rank,
            on_micro_batch=self._on_micro_batch, on_batch_closed=self._on_batch_closed,
            on_group_dropped=self._on_group_dropped)
        # without RA2P, ERS moves ranks but never provisions a Ref rank
        ers_ra2p = config.ra2p if system.uses_ra2p else replace(config.ra2p, mode="colocated")
        self.ers = ERSPolicy(config.ers, ers_ra2p) if system.uses_ers and config.ers.enabled \
            else None
        self.phase = Phase.LAUNCHING
        self.step = self.version = 0
        self.t0 = self.trainer_free_at = self._now = now
        self.current: OpenStep | None = None
        self.retry: OpenStep | None = None  # a step a trainer rank died in, to open again
        self.boundary: PendingBoundary | None = None
        self.boundary_version = -1  # the version of the last boundary sent
        self.waiting: dict[int, list[MicroBatch]] = {}
        self.closed: set[int] = set()
        self.ra2p_mode = Mode.COLOCATED
        self.passes: dict[Mode, MeasuredPasses] = {}  # the last measurement of each layout
        self.plan_reason: PlanReason | None = None
        self.manual_pending: tuple[ManualRequest, ScalingPlan] | None = None
        self.is_manual_held = False  # an operator's layout runs; ERS waits for a release
        self.is_cold_start = False  # the launch plan lent trainer ranks; step 0 waits for batch 0
        self.records: list[StepRecord] = []
        self.trained_tokens = self.trained_samples = 0
        self.num_fed = self.num_retired = self.failed_samples = 0
        self.is_retire_pending = False
        self.evaluation = Evaluation(config.eval_every, config.eval_groups)
        self.is_eval_hold = False  # the post-update boundary waits for the evaluation's groups
        self.groups = GroupCount()
        self.fed_specs: dict[str, GroupSpec] = {}  # training groups fed, not yet back
        self._kv_mark = (0, 0)
        self._out: list[Command] = []

    # ------------------------------------------------------------------ queries

    @property
    def book(self) -> TaskBook:
        return self.rollout.book

    @property
    def system(self) -> SystemSpec:
        return self.config.system

    def signals(self, now: float) -> ReadinessSignals:
        return self.tracker.signals(now)

    def budgets(self) -> dict[int, int]:
        """CTB's token budget B_r of every rank it places tasks on."""
        return {rank: record.budget for rank, record in self.book.ranks.items()}

    def rollout_ranks(self) -> list[int]:
        return [r for r, role in enumerate(self.roles)
                if (role is Role.ROLLOUT or self.system.is_sync) and r not in self.dead]

    # ------------------------------------------------------------------ events

    def launch(self, now: float) -> list[Command]:
        """The job starts: the ERS launch plan (a cold start lends trainer ranks to rollout),
        CTB's ranks, the first groups and, without a launch boundary, step 0."""
        self._at(now)
        self.t0 = self.trainer_free_at = now
        self.rollout.restart_clock(now)
        self.tracker.start_step(now)
        self.buffer.num_dp_ranks = self._dp_ranks(tuple(self.roles))
        self.phase = Phase.BOUNDARY
        if self.ers is not None:
            self._plan(now, is_launch=True)
        joining = self.boundary.joining if self.boundary is not None else set()
        for rank in self.rollout_ranks():
            if rank not in joining:  # a rank the launch plan moved joins once its engine is up
                self._join(rank, now)
        self._feed(now)
        self._feed_eval(now)
        if self.boundary is None:
            self._want_step(now)
        return self._flush()

    def schedule(self, now: float) -> list[Decision]:
        """One CTB round (see :meth:`RolloutControl.schedule`)."""
        self._at(now)
        return self.rollout.schedule(now)

    def group_ready(self, group_id: str, group: ReadyGroup | None, now: float) -> list[Command]:
        """Every task of a group finished. ``group`` holds its training sequences; None when a
        task produced no turn (the group cannot be trained). Evaluation groups are never
        trained: their end only ends the evaluation phase."""
        self._at(now)
        if group_id in self.evaluation.in_flight:
            if self.evaluation.finish(group_id):
                self._eval_drained(now)
            return self._flush()
        self.fed_specs.pop(group_id, None)
        if group is None:
            self.groups.failed += 1
            self.failed_samples += self.config.group_size
            self._out.append(GroupDropped(group_id, DropReason.NO_TURN, None,
                                          self.buffer.open_batch))
            self._free_window(self.config.group_size, now)
        else:
            self.groups.ready += 1
            self.buffer.add_group(group, now)
        return self._flush()

    def step_done(self, outcome: StepOutcome, now: float) -> list[Command]:
        """Every trainer rank of the open step reported: its record, then the boundary."""
        self._at(now)
        current = self.current
        if self.phase is not Phase.TRAINING or current is None \
                or outcome.step != current.start.step:
            raise StepControlError(f"step {outcome.step} is not the open step "
                                   f"({'none' if current is None else current.start.step})")
        self.phase = Phase.BOUNDARY
        if not self.settle_step(current, outcome, now):
            return self._flush()
        layout = Mode.DECOUPLED if current.start.mode is StepMode.DECOUPLED else Mode.COLOCATED
        self.passes[layout] = learn_passes(outcome.reports, current.start)
        self.rollout.park(now, False)
        record = self._record(current, outcome, now)
        self.records.append(record)
        self._out.append(RecordStep(record))
        self.current = None
        self.step += 1
        self.version += 1
        self.trainer_free_at = now
        self.is_retire_pending = True
        if self.step >= self.config.num_steps:
            self._boundary(now, self.roles, None, is_final=True)
            self.phase = Phase.FINISHED
            self._out.append(Finish(self.step))
            return self._flush()
        if self.evaluation.in_flight and not self.system.is_sync:
            self.is_eval_hold = True  # see _eval_drained
            return self._flush()
        self._post_update(now)
        return self._flush()

    def _post_update(self, now: float) -> None:
        """The boundary after an update: an operator's pending plan, else ERS's, else the same
        layout with the new weights."""
        if not self._apply_manual(now):
            if self.ers is not None and not self.is_manual_held:
                self._plan(now)
            else:
                self._boundary(now, self.roles, None)
        self._maybe_retire(now)

    def _eval_drained(self, now: float) -> None:
        """The evaluation's last group is back. It ran on an anchored version (paper Table 1:
        stalling it "blocks global weight synchronization"), so a weight sync due meanwhile
        goes out now; a synchronous step, whose engines it shared, may now train."""
        if self.is_eval_hold:
            self.is_eval_hold = False
            self._post_update(now)
        elif self.phase is Phase.WAITING:
            self._want_step(now)

    def boundary_acked(self, rank: int, version: int, now: float) -> list[Command]:
        """``rank`` took the boundary of ``version`` (its role and, after an update, the new
        weights); answers for another boundary, or from a rank not awaited, change nothing."""
        self._at(now)
        pending = self.boundary
        if pending is None or version != pending.version or rank not in pending.awaiting:
            return []
        pending.awaiting.discard(rank)
        if rank in pending.joining:
            pending.joining.discard(rank)
            if rank in self.rollout_ranks():
                self._join(rank, now)
        if rank in pending.syncing:
            pending.syncing.discard(rank)
            self._maybe_retire(now)
        self._maybe_complete(now)
        return self._flush()

    def engine_capacity(self, rank: int, kv_tokens: int, now: float) -> list[Command]:
        """A rank's engine holds ``kv_tokens`` of KV (a server sizes its own): B_r follows."""
        self._at(now)
        if kv_tokens > 0:
            self.rollout.set_rank_budget(rank, self.config.ctb.rank_budget(kv_tokens))
        return self._flush()

    # ------------------------------------------------------------------ the boundary

    def _plan(self, now: float, is_launch: bool = False, is_phase_over: bool = False) -> None:
        """ERS plans the next step's layout, RA2P mode and batch; the layout limits may refuse
        its roles (the mode and batch still apply)."""
        assert self.ers is not None
        memory = self.ers.state
        num_eval = self.evaluation.num_unfinished(self.step)
        plan = self.ers.plan(ers_input(
            step=self.step, is_eval_step=self.evaluation.is_phase(self.step),
            signals=self.signals(now),
            records=self.records, roles=self.roles, mode=self.ra2p_mode, measured=self.passes,
            phase_tasks=num_eval * self.config.group_size,
            tasks_per_rank=self.rollout.tasks_per_rank(), is_phase_over=is_phase_over,
            rate_steps=self.ers.config.predictive_window
            if self.ers.config.planner == "predictive" else 0))
        self.plan_reason = plan.reason
        if is_launch:
            self.is_cold_start = plan.reason is PlanReason.COLD_START and bool(plan.changes)
        roles = self._planned(plan.changes)
        refusal = self.config.limits.refusal(self.roles, roles)
        if refusal is not None:
            self._out.append(PlanRefused(refusal, plan.reason))
            roles = list(self.roles)
            self.ers.state = memory  # its hysteresis and phase memory: the moves did not happen
        self.ra2p_mode = plan.mode
        if not is_launch and not self.system.streams:
            # Step 0 trains B_ideal: nothing is ready yet to size it from. A streaming step
            # trains B_ideal too: what is ready at its boundary is not what it will consume (it
            # takes micro-batches as they come), and a shrunken batch closes early and ages the
            # groups behind it out of the staleness window (fig8: 16 M tokens discarded).
            # The staleness window stays B_ideal wide: sizing it by the elastic batch would
            # throttle rollout exactly when ERS shrinks a batch because too little was ready.
            self.buffer.set_batch_size(self.step, plan.batch_size, now)
        self._boundary(now, roles, plan.reason)

    def _boundary(self, now: float, roles: list[Role], reason: PlanReason | None,
                  is_final: bool = False, is_resume: bool = False) -> None:
        """``is_resume``: the launch of a resumed job (:mod:`.resume`): every rank gets the
        weights of ``version``, and the rollout ranks take tasks once they have them. A
        checkpoint and an export are due at the first boundary of a version (after its update),
        never at another one of the same version (a layout change without an update, or a
        boundary sent again without a dead rank)."""
        if not is_final and self._lacks_rollout(roles):
            moved = self.config.limits.with_rollout(roles, self.dead)
            if moved is None:
                self._out.append(Abort("no rollout rank is left and no trainer rank can move "
                                       "to rollout"))
            roles, reason = moved or roles, PlanReason.NO_ROLLOUT
        old, new = tuple(self.roles), tuple(roles)
        old_actors = self._actors(old)
        new_actors = self._actors(new)
        keep = sorted(old_actors & new_actors)
        if not keep:
            raise StepControlError(f"a plan left no actor in place ({old} -> {new})")
        for rank, (src, dst) in enumerate(zip(old, new, strict=True)):
            if src is Role.ROLLOUT and dst is not Role.ROLLOUT and rank in self.book.ranks:
                self._out.append(LeaveRollout(rank, self.rollout.remove_rank(rank, now)))
        self.roles = list(new)
        self.buffer.num_dp_ranks = self._dp_ranks(new)  # what comes next is cut for it
        is_update = self.version != self.boundary_version
        self.boundary_version = self.version

        def is_due(every: int) -> bool:  # not the launch's boundary, nor a resume's
            return bool(is_final or (not is_resume and is_update and every and self.version
                                     and self.version % every == 0))

        members = tuple(r for r in range(len(new)) if r not in self.dead)
        self._out.append(Boundary(
            self.version, new, old, members, keep[0], tuple(sorted(new_actors - old_actors)),
            reason, checkpoint=is_due(self.config.checkpoint_every),
            export=is_due(self.config.export_every), is_final=is_final))
        if is_final:
            return
        rollout = {r for r in members if new[r] is Role.ROLLOUT or self.system.is_sync}
        joining = set(rollout) if is_resume else {
            r for r in members if new[r] is Role.ROLLOUT and old[r] is not Role.ROLLOUT}
        self.boundary = PendingBoundary(self.version, set(members),
                                        rollout if self.version > 0 else set(),
                                        joining - set(self.book.ranks), old, reason, is_resume)

    def _lacks_rollout(self, roles: list[Role]) -> bool:
        return not self.system.is_sync and not any(
            role is Role.ROLLOUT for r, role in enumerate(roles) if r not in self.dead)

    def _free_window(self, num_samples: int, now: float) -> None:
        """Samples that will never train (a failed or stale group) leave the staleness window
        at once: held to the next boundary, they could hold it forever, since that boundary
        may wait for the very batch they were to fill."""
        self.book.retire(num_samples)
        self.num_retired += num_samples
        self._out.append(Retire(num_samples, self.book.train_admission_limit))
        self._feed(now)

    def _dp_ranks(self, roles: tuple[Role, ...]) -> int:
        """Data-parallel ranks of the actors: each model replica spans ``tensor_parallel``."""
        return max(1, len(self._actors(roles)) // self.config.tensor_parallel)

    def _actors(self, roles: tuple[Role, ...]) -> set[int]:
        """The actor ranks of ``roles``: every live rank under ``is_sync``."""
        return {r for r, role in enumerate(roles)
                if role is Role.ACTOR or (self.system.is_sync and role is not Role.IDLE)}

    def _planned(self, changes: tuple[RoleChange, ...]) -> list[Role]:
        return planned_roles(self.roles, changes)

    def _maybe_retire(self, now: float) -> None:
        """Move the staleness window once every rollout rank has the new version."""
        if not self.is_retire_pending or (self.boundary is not None and self.boundary.syncing):
            return
        self.is_retire_pending = False
        retired = self.trained_samples + self.buffer.discarded_samples + self.failed_samples
        self.book.retire(retired - self.num_retired)
        self._out.append(Retire(retired - self.num_retired, self.book.train_admission_limit))
        self.num_retired = retired
        self._feed(now)

    def _maybe_complete(self, now: float) -> None:
        if self.boundary is None or self.boundary.awaiting:
            return
        self.boundary = None
        if self.phase is Phase.BOUNDARY:
            if self.step > 0:
                self._feed_eval(now)
            self._want_step(now)

    def _join(self, rank: int, now: float) -> None:
        self.rollout.add_rank(rank, now)
        self._out.append(JoinRollout(rank, self.rollout.budget))

    # ------------------------------------------------------------------ feeding

    def _feed(self, now: float) -> None:
        """Training groups up to the book's staleness throttle: retired tasks plus
        (max_staleness + 1) batches."""
        limit = self.book.train_admission_limit
        horizon = -(-limit // self.config.group_size) if limit is not None else 0
        specs = []
        while self.num_fed < horizon:
            specs.append(GroupSpec(f"g{self.num_fed}", self.num_fed, False, self.step))
            self.fed_specs[specs[-1].group_id] = specs[-1]
            self.rollout.add_group(self.source(specs[-1]), now)
            self.num_fed += 1
        if specs:
            self.groups.fed += len(specs)
            self._out.append(FeedGroups(tuple(specs), is_eval=False))

    def _feed_eval(self, now: float) -> None:
        """An evaluation phase when one is due (:class:`Evaluation`): its groups go out beside
        the staleness throttle, never trained."""
        specs = self.evaluation.feed(self.step)
        for spec in specs:
            self.rollout.add_group(self.source(spec), now)
        if specs:
            self._out.append(FeedGroups(specs, is_eval=True))

    # ------------------------------------------------------------------ steps

    def _want_step(self, now: float) -> None:
        """Open step ``self.step`` now, or (whole-batch systems, and during the cold start) once
        its batch is complete; a synchronous step also waits for an evaluation to end (its
        engines are the trainer's GPUs)."""
        is_eval_blocking = self.system.is_sync and bool(self.evaluation.in_flight)
        if not self.rollout_ranks() and not self.system.is_sync:
            self.phase = Phase.WAITING
            self._check_rollout_left(-1)
            if self.step not in self.closed:
                return
        if self.is_cold_start and self.step in self.closed:
            self._end_cold_start(now)
        elif not self.is_cold_start and not is_eval_blocking \
                and (self.system.streams or self.step in self.closed):
            self._open_step(now)
        else:
            self.phase = Phase.WAITING

    def _end_cold_start(self, now: float) -> None:
        """Batch 0 is ready: the ranks the cold start lent come back before step 0 opens (a
        boundary without an update; step 0 opens once it is acknowledged), so no batch trains
        on the trainer's minimum."""
        self.is_cold_start = False
        self.phase = Phase.BOUNDARY
        self.trainer_free_at = now  # the lent ranks rolled out until now: no trainer wait
        self._plan(now, is_phase_over=True)

    def _open_step(self, now: float) -> None:
        """Step ``self.step`` opens: its micro-batches so far go out. A step that runs again
        (:meth:`_run_again`) first sends the ones its failed attempt had."""
        self.phase = Phase.TRAINING
        retry, self.retry = self.retry, None
        start = self._layout_step(self.signals(now))  # TPRM of the arrivals so far
        self.buffer.num_dp_ranks = dp_ranks = max(1, len(start.actor_ranks)
                                                  // self.config.tensor_parallel)
        waiting = self.buffer.recut(self.step, self.waiting.pop(self.step, []), dp_ranks)
        if retry is None:
            self.tracker.start_step(now)
            ready_at = now if self.system.is_sync else self.trainer_free_at  # sync: rolling out
            self.current = OpenStep(start, now, ready_at, self.tracker.step_ras)
        else:
            start = self._retry_start(start, retry)
            self.current = replace(retry, start=start, num_mbs=0, sent=[], is_closed=False,
                                   is_aborted=False)
        self.rollout.park(now, self.system.is_sync)
        self._out.append(start)
        for mb in retry.sent if retry is not None else ():
            self._send_micro_batch(mb)
        for mb in waiting:
            self._dispatch(mb)
        if self.step in self.closed:
            self.closed.discard(self.step)
            self._out.append(CloseStep(self.step))
            self.current.is_closed = True

    def _layout_step(self, signals: ReadinessSignals) -> StartStep:
        """The step's mode and ranks. ERS plans the mode with the layout (its break-even is
        RA2P's cost model); without ERS, and outside a held manual plan, RA2P chooses each step.
        A colocated step runs on the actor ranks only (a Ref rank then waits)."""
        if self.system.is_sync:
            return StartStep(self.step, StepMode.BATCH, (),
                             tuple(sorted(self._actors(tuple(self.roles)))), 0)
        actors = tuple(r for r, role in enumerate(self.roles) if role is Role.ACTOR)
        refs = tuple(r for r, role in enumerate(self.roles) if role is Role.REF)
        fixed = self.system.fixed_step_mode
        if fixed is not None:
            return StartStep(self.step, fixed, (), actors, 0 if fixed is StepMode.BATCH else 1)
        if not refs:
            self.ra2p_mode = Mode.COLOCATED
        elif self.ers is None and not self.is_manual_held:
            self.ra2p_mode = choose_step_mode(self.config.ra2p, signals, self.passes, len(refs),
                                              len(actors), self.records)
        if self.ra2p_mode is Mode.DECOUPLED:
            return StartStep(self.step, StepMode.DECOUPLED, refs, actors, 1)
        return StartStep(self.step, StepMode.COLOCATED, (), actors, self.config.ra2p.max_aggregate)

    def _dispatch(self, mb: MicroBatch) -> None:
        current = self.current
        assert current is not None
        for seq in mb.sequences:  # a group's samples count with its first sequence
            group = self.buffer.group_of_seq[seq.seq_id]
            if group.group_id not in current.group_ids:
                current.group_ids.add(group.group_id)
                current.samples += group.num_samples
        current.tokens += self.buffer.consume(current.start.step, mb)
        self._send_micro_batch(mb)

    def _send_micro_batch(self, mb: MicroBatch) -> None:
        current = self.current
        assert current is not None
        self._out.append(Dispatch(current.start.step, current.num_mbs, mb))
        current.sent.append(mb)
        current.num_mbs += 1

    def _is_open(self, batch: int) -> bool:
        """Step ``batch`` is open and takes micro-batches (not an attempt a rank died in)."""
        current = self.current
        return current is not None and not current.is_aborted and batch == current.start.step

    def _on_micro_batch(self, batch: int, mb: MicroBatch) -> None:
        if self._is_open(batch) and self.system.streams:
            self._dispatch(mb)
        else:
            self.waiting.setdefault(batch, []).append(mb)

    def _on_batch_closed(self, batch: int) -> None:
        if self._is_open(batch):
            assert self.current is not None
            self._out.append(CloseStep(batch))
            self.current.is_closed = True
            return
        self.closed.add(batch)
        if self.phase is Phase.WAITING and batch == self.step:
            self._want_step(self._now)

    def _on_group_dropped(self, group: ReadyGroup) -> None:
        self.groups.stale += 1
        self._out.append(GroupDropped(group.group_id, DropReason.STALE, group.oldest_version,
                                      self.buffer.open_batch))
        self._free_window(group.num_samples, self._now)

    # ------------------------------------------------------------------ the record

    def _record(self, current: OpenStep, outcome: StepOutcome, now: float) -> StepRecord:
        self.trained_tokens += current.tokens
        self.trained_samples += current.samples
        self.groups.trained_ids |= current.group_ids
        start = current.start
        loss, grad_norm, loss_tokens = outcome.actor_figures(start.actor_ranks)
        twt = sum(r.wait_s for r in outcome.reports)
        twt += (current.opened_at - current.ready_at) * len(start.ranks)
        rwt, saturated, generating_share = self.rollout.interval()
        queries, hits = outcome.kv_queries - self._kv_mark[0], outcome.kv_hits - self._kv_mark[1]
        self._kv_mark = (outcome.kv_queries, outcome.kv_hits)
        return StepRecord(
            step=start.step, start_s=current.opened_at - self.t0, end_s=now - self.t0,
            trained_tokens=current.tokens, trained_tokens_total=self.trained_tokens,
            trained_samples=current.samples,
            generated_tokens_total=self.rollout.generated_tokens,
            discarded_tokens_total=self.buffer.discarded_tokens, ras=current.ras,
            tprm_s=self.tracker.signals(now).tprm_s, rwt_s=rwt, twt_s=twt, mode=start.mode,
            roles=tuple(role.value for role in self.roles),
            num_rollout=len(self.rollout_ranks()), num_trainer=len(start.ranks),
            num_micro_batches=current.num_mbs,
            kv_hit_rate=hits / queries if queries > 0 else None,
            staleness_max=self.buffer.max_staleness_seen.get(start.step, 0),
            reward_mean=outcome.reward_mean, solved_frac=outcome.solved_frac,
            eval_reward=outcome.eval_reward,
            loss=loss, grad_norm=grad_norm, batch_size=current.samples,
            ers_reason=self.plan_reason.value if self.plan_reason is not None else None,
            trained_loss_tokens=loss_tokens, rollout_saturated_s=saturated,
            generating_share=generating_share)

    # ------------------------------------------------------------------ plumbing

    def _at(self, now: float) -> None:
        self._now = now

    def _flush(self) -> list[Command]:
        out, self._out = self._out, []
        return out
