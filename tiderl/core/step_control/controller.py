"""The step controller: the step cycle of :mod:`tiderl.core.step_control` as one object, composed
of the parts the package docstring lists (each owns its state; none calls another: a part takes
what it reads as arguments and returns what happened, and this object applies it). Events in are
its public methods (time is an argument); each returns the commands the adapter applies, in
order (:mod:`tiderl.core.commands`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tiderl.core.buffer import BufferEvents, BufferShape, ReadyBuffer, ReadyGroup
from tiderl.core.commands import (
    Abort,
    AbortStep,
    Command,
    DropReason,
    FeedGroups,
    Finish,
    GroupDropped,
    GroupSpec,
    JoinRollout,
    LeaveRollout,
    ManualReply,
    ManualRequest,
    PlanRefused,
    RecordStep,
    Retire,
    StepOutcome,
)
from tiderl.core.ers import ERSPolicy
from tiderl.core.readiness import ReadinessTracker
from tiderl.core.step_control.boundary import Boundaries, dp_ranks, with_rollout_rank
from tiderl.core.step_control.config import StepControlConfig, StepControlError
from tiderl.core.step_control.evaluation import Evaluation
from tiderl.core.step_control.faults import (
    Death,
    NoRollout,
    Settlement,
    on_death,
    rollout_left,
    settle,
)
from tiderl.core.step_control.feed import TrainingFeed
from tiderl.core.step_control.inputs import ers_input, rate_steps
from tiderl.core.step_control.ledger import Ledger
from tiderl.core.step_control.manual import ManualPlans, planned_roles
from tiderl.core.step_control.rollout import RolloutControl
from tiderl.core.step_control.state import CycleState, Hold, Phase, actors
from tiderl.core.step_control.steps import StepRunner, step_start
from tiderl.core.types import Decision, Group, PlanReason, Role


class StepController:
    """See the module docstring. ``source`` turns a :class:`GroupSpec` into the group's tasks
    (the adapter's dataset: environment and seed of each task)."""

    def __init__(self, config: StepControlConfig, roles: list[Role],
                 source: Callable[[GroupSpec], Group], now: float = 0.0) -> None:
        self.config, self.source = config, source
        job = config.job
        self.state = CycleState(list(roles), t0=now, trainer_free_at=now)
        self.rollout = RolloutControl.of(config.ctb, budget=config.rank_budget,
                                         max_new_tokens=config.max_new_tokens,
                                         max_staleness=config.max_staleness,
                                         tasks_per_step=config.window_tasks, now=now,
                                         block_tokens=config.kv_block_tokens)
        self.tracker = ReadinessTracker(now)
        self.buffer: ReadyBuffer = ReadyBuffer(self.tracker, BufferShape(
            job.group_size, job.batch_ideal, config.drop_staleness, config.ra2p.tokens_per_rank))
        self.ers = ERSPolicy(config.ers, config.ra2p) if config.has_ers else None
        self.feed = TrainingFeed(job.group_size)
        self.evaluation = Evaluation(job.eval_every, job.eval_groups, job.group_size)
        self.boundaries = Boundaries()
        self.steps = StepRunner()
        self.ledger = Ledger()
        self.manual = ManualPlans()

    # ------------------------------------------------------------------ queries

    def rollout_ranks(self) -> list[int]:
        is_sync = self.config.system.is_sync
        return [r for r, role in enumerate(self.state.roles)
                if (role is Role.ROLLOUT or is_sync) and r not in self.state.dead]

    # ------------------------------------------------------------------ events

    def launch(self, now: float) -> list[Command]:
        """The job starts: the ERS launch plan (a cold start lends trainer ranks to rollout),
        CTB's ranks, the first groups and, without a launch boundary, step 0."""
        st = self.state
        st.t0 = st.trainer_free_at = now
        self.rollout.restart_clock(now)
        self.tracker.start_step(now)
        self.buffer.num_dp_ranks = dp_ranks(st.roles, self.config)
        st.to(Phase.BOUNDARY)
        out = self._plan(now, is_launch=True) if self.ers is not None else []
        pending = self.boundaries.pending
        joining = pending.joining if pending is not None else set()
        # a rank the launch plan moved joins once its engine is up
        out += [self._join(rank, now) for rank in self.rollout_ranks() if rank not in joining]
        out += self._feed(now) + self._feed_eval(now)
        if self.boundaries.pending is None:
            out += self._want_step(now)
        return out

    def restore_boundary(self, ready: Sequence[ReadyGroup], in_flight: Sequence[GroupSpec],
                         now: float) -> list[Command]:
        """A resumed job's launch, once :func:`.resume.restore` set the parts to its resume
        point: its version's weights to every rank (the rollout ranks take tasks once they have
        them), its ready groups back in the buffer, its groups in flight run again."""
        out = self._boundary(now, self.state.roles, None, is_resume=True)
        for group in ready:
            self.feed.count.ready += 1
            out += self._on_buffer(self.buffer.add_group(group, now), now)
        self.feed.out.update((spec.group_id, spec) for spec in in_flight)
        return out + self._send_groups(in_flight, False, now)

    def schedule(self, now: float) -> list[Decision]:
        return self.rollout.schedule(now)  # one CTB round: Admit / Pause / Resume

    def group_ready(self, group_id: str, group: ReadyGroup | None, now: float) -> list[Command]:
        """Every task of a group finished: ``group`` holds its training sequences (None: a task
        played no turn, it cannot train). An evaluation group's end only ends its phase."""
        if group_id in self.evaluation.in_flight:
            return self._evaluation_done(now) if self.evaluation.finish(group_id) else []
        self.feed.back(group_id, is_trainable=group is not None)
        if group is None:
            dropped = GroupDropped(group_id, DropReason.NO_TURN, None, self.buffer.open_batch)
            return [dropped, *self._retire(self.config.job.group_size, now)]
        return self._on_buffer(self.buffer.add_group(group, now), now)

    def step_done(self, outcome: StepOutcome, now: float) -> list[Command]:
        """Every trainer rank of the open step reported: its record, then the boundary."""
        st, current = self.state, self.steps.current
        if st.phase is not Phase.TRAINING or current is None \
                or outcome.step != current.start.step:
            raise StepControlError(f"step {outcome.step} is not the open step "
                                   f"({'none' if current is None else current.start.step})")
        st.to(Phase.BOUNDARY)
        verdict, why = settle(current, outcome, st.dead)
        if verdict is Settlement.REPLICAS_DIFFER:
            return [Abort(why)]
        if verdict is Settlement.RUN_AGAIN:
            return self._run_again(now)
        self.steps.learn(outcome.reports, current.start)
        self.rollout.park(now, False)
        record = self.ledger.record(current, outcome, now, state=st, rollout=self.rollout,
                                    buffer=self.buffer, tprm_s=self.tracker.signals(now).tprm_s,
                                    num_rollout=len(self.rollout_ranks()))
        self.feed.count.trained_ids |= current.group_ids
        self.steps.current = None
        st.updated(now)
        out: list[Command] = [RecordStep(record)]
        if st.step >= self.config.job.steps:
            out += self._boundary(now, st.roles, None, is_final=True)
            st.to(Phase.FINISHED)
            return [*out, Finish(st.step)]
        if self.evaluation.in_flight and not self.config.system.is_sync:
            st.set_hold(Hold.EVALUATION)  # released when its last group is back
            return out
        return out + self._post_update(now)

    def boundary_acked(self, rank: int, version: int, now: float) -> list[Command]:
        """``rank`` took the boundary of ``version`` (its role and, after an update, the new
        weights); answers for another boundary, or from a rank not awaited, change nothing."""
        acked = self.boundaries.acknowledge(rank, version)
        if acked is None:
            return []
        is_joining, is_syncing = acked
        out = []
        if is_joining and rank in self.rollout_ranks():
            out.append(self._join(rank, now))
        if is_syncing:
            out += self._retire_trained(now)
        return out + self._complete_boundary(now)

    def engine_capacity(self, rank: int, kv_tokens: int, now: float,
                        prefill_tokens_per_s: float = 0.0) -> list[Command]:
        """A rank's engine holds ``kv_tokens`` of KV (a server sizes its own): B_r follows; and
        prefills ``prefill_tokens_per_s`` (measured; 0: not yet)."""
        if kv_tokens > 0:
            self.rollout.set_rank_budget(rank, self.config.ctb.rank_budget(kv_tokens))
        if prefill_tokens_per_s > 0:
            self.rollout.set_prefill_rate(rank, prefill_tokens_per_s)
        return []

    def rank_dead(self, rank: int, why: str, now: float) -> list[Command]:
        """A rank is gone (:mod:`.faults` says what that means)."""
        st, current, pending = self.state, self.steps.current, self.boundaries.pending
        death, reason = on_death(rank, why, st, pending, current, self.config.limits,
                                 self.config.system.is_sync)
        if death is Death.IGNORED:
            return []
        st.dead.add(rank)
        if death is Death.STOP:
            return [Abort(reason)]
        out: list[Command] = []
        if rank in self.rollout.book.ranks:
            out.append(LeaveRollout(rank, self.rollout.remove_rank(rank, now), True))
        st.roles[rank] = Role.IDLE
        if death is Death.ABORT_STEP:
            assert current is not None  # what the buffer forms now waits for the next attempt
            current.is_aborted = True
            out.append(AbortStep(current.start.step, current.start.attempt))
        elif death is Death.BOUNDARY_AGAIN:
            out += self._boundary_again(now)
        elif death is Death.TRAINER_LOST:
            st.to(Phase.BOUNDARY)
            out += self._boundary(now, st.roles, PlanReason.TRAINER_LOST)
        elif death is Death.LEAVE:
            if pending is not None:  # the boundary it was in completes without it
                pending.forget(rank)
            out += self._retire_trained(now) + self._complete_boundary(now)
            out += self._check_rollout_left(rank, now)
        return out

    def submit_manual(self, request: ManualRequest, now: float) -> list[ManualReply]:
        return self.manual.submit(request, self.config, self.state)  # refused, or pending

    def release_manual(self, key: object, now: float) -> list[ManualReply]:
        return self.manual.release(key, self.config, self.state)  # --auto

    # ------------------------------------------------------------------ the boundary

    def _post_update(self, now: float) -> list[Command]:
        """The boundary after an update: an operator's pending plan, else ERS's, else the same
        layout with the new weights."""
        st = self.state
        taken, out = self.manual.take(self.config, st)
        if taken is not None:
            request, plan = taken
            roles = planned_roles(st.roles, plan.changes)
            st.placement, st.plan_reason = plan.placement, plan.reason
            if self.ers is not None:
                self.ers.reset()  # its hysteresis and phase memory were about the old layout
            out += self._boundary(now, roles, plan.reason)
            out.append(ManualReply(request, request.key, "applied", st.step, version=st.version,
                                   roles=tuple(roles), placement=plan.placement,
                                   is_at_boundary=True))
        elif self.ers is not None and not self.manual.is_held:
            out += self._plan(now)
        else:
            out += self._boundary(now, st.roles, None)
        return out + self._retire_trained(now)

    def _plan(self, now: float, is_launch: bool = False,
              is_phase_over: bool = False) -> list[Command]:
        """ERS plans the next step's layout and RA2P placement; the layout limits may refuse its
        roles (the placement still applies, and ERS keeps its old state: no move happened)."""
        st, ers = self.state, self.ers
        assert ers is not None
        plan, after = ers.propose(ers_input(
            step=st.step, is_eval_step=self.evaluation.is_phase(st.step),
            signals=self.tracker.signals(now), records=self.ledger.records, roles=st.roles,
            placement=st.placement, measured=self.steps.passes, batch=self.config.job.batch,
            phase_tasks=self.evaluation.num_unfinished_tasks(st.step),
            tasks_per_rank=self.rollout.tasks_per_rank(), is_phase_over=is_phase_over,
            rate_steps=rate_steps(ers.config), idle_steps=ers.config.idle_window))
        st.plan_reason = plan.reason
        if is_launch and plan.reason is PlanReason.COLD_START and plan.changes:
            st.set_hold(Hold.COLD_START)  # released when batch 0 is complete
        roles = planned_roles(st.roles, plan.changes)
        out: list[Command] = []
        refusal = self.config.limits.refusal(st.roles, roles)
        if refusal is None:
            ers.state = after
        else:
            out.append(PlanRefused(refusal, plan.reason))
            roles = list(st.roles)
        # The plan's elastic batch is not applied: ERS runs under TideRL, whose steps stream, and
        # a streaming step trains B_ideal (what is ready at its boundary is not what it will
        # consume, and a shrunken batch closes early and ages the groups behind it out of the
        # staleness window: fig8 discarded 16 M tokens so).
        st.placement = plan.placement
        return out + self._boundary(now, roles, plan.reason)

    def _boundary(self, now: float, roles: list[Role], reason: PlanReason | None, *,
                  is_final: bool = False, is_resume: bool = False) -> list[Command]:
        """The layout ``roles`` (a trainer rank moved to rollout if no live rank would roll
        out) with the weights of this version; the ranks that leave rollout leave CTB now."""
        st, out = self.state, []
        if not is_final:
            roles, reason, out = with_rollout_rank(roles, reason, st.dead, self.config)
        old = list(st.roles)
        for rank, (src, dst) in enumerate(zip(old, roles, strict=True)):
            if src is Role.ROLLOUT and dst is not Role.ROLLOUT and rank in self.rollout.book.ranks:
                out.append(LeaveRollout(rank, self.rollout.remove_rank(rank, now)))
        out.append(self.boundaries.send(self.config, old, roles, version=st.version,
                                        dead=st.dead, reason=reason,
                                        placed=set(self.rollout.book.ranks), is_final=is_final,
                                        is_resume=is_resume))
        st.roles = list(roles)
        self.buffer.num_dp_ranks = dp_ranks(st.roles, self.config)  # what comes next is cut so
        return out

    def _boundary_again(self, now: float) -> list[Command]:
        """The boundary out, sent again from the layout before it with the dead ranks left out
        (and so from a live source: an actor before and after it)."""
        st, pending = self.state, self.boundaries.pending
        assert pending is not None and pending.old_roles
        new = list(st.roles)
        st.roles = [Role.IDLE if r in st.dead else role for r, role in enumerate(pending.old_roles)]
        return self._boundary(now, new, pending.reason, is_resume=pending.is_resume)

    def _complete_boundary(self, now: float) -> list[Command]:
        if not self.boundaries.complete() or self.state.phase is not Phase.BOUNDARY:
            return []
        return (self._feed_eval(now) if self.state.step > 0 else []) + self._want_step(now)

    def _join(self, rank: int, now: float) -> JoinRollout:
        self.rollout.add_rank(rank, now)
        return JoinRollout(rank, self.rollout.budget)

    # ------------------------------------------------------------------ feeding and the window

    def _feed(self, now: float) -> list[Command]:
        """Training groups up to the book's staleness throttle."""
        limit = self.rollout.book.train_admission_limit
        return self._send_groups(self.feed.due(limit, self.state.step), False, now)

    def _feed_eval(self, now: float) -> list[Command]:
        """An evaluation phase when one is due: its groups go out beside the throttle."""
        return self._send_groups(self.evaluation.feed(self.state.step), True, now)

    def _send_groups(self, specs: Sequence[GroupSpec], is_eval: bool,
                     now: float) -> list[Command]:
        for spec in specs:
            self.rollout.add_group(self.source(spec), now)
        return [FeedGroups(tuple(specs), is_eval)] if specs else []

    def _evaluation_done(self, now: float) -> list[Command]:
        """The evaluation's last group is back: a weight sync held for its anchored version goes
        out now (paper Table 1); a synchronous step, whose engines it shared, may now train."""
        st = self.state
        if st.hold is Hold.EVALUATION:
            st.set_hold(None)
            return self._post_update(now)
        return self._want_step(now) if st.phase is Phase.WAITING else []

    def _retire(self, num_samples: int, now: float) -> list[Command]:
        """``num_samples`` training samples leave the staleness window: more groups may go out.
        A failed or stale group's leave at once (held to the next boundary, they could hold it
        for ever: that boundary may wait for the very batch they were to fill)."""
        self.rollout.book.retire(num_samples)
        return [Retire(num_samples, self.rollout.book.train_admission_limit), *self._feed(now)]

    def _retire_trained(self, now: float) -> list[Command]:
        """The trained samples leave the window once every rollout rank has the new version."""
        retired = self.ledger.trained_samples + self.buffer.discarded.samples \
            + self.feed.failed_samples
        lag = retired - self.rollout.book.num_retired_train
        return self._retire(lag, now) if lag > 0 and not self.boundaries.is_syncing else []

    # ------------------------------------------------------------------ steps

    def _on_buffer(self, events: BufferEvents, now: float) -> list[Command]:
        """What the buffer did, batch by batch: its stale groups, its micro-batches (to the open
        step, or waiting for theirs), its end."""
        out: list[Command] = []
        is_streaming = self.config.system.streams
        for batch in events.batches:
            for group in (g for b, g in events.dropped if b == batch):
                self.feed.count.stale += 1
                out.append(GroupDropped(group.group_id, DropReason.STALE, group.oldest_version,
                                        batch))
                out += self._retire(group.num_samples, now)
            for mb in (mb for b, mb in events.micro_batches if b == batch):
                out += self.steps.take(batch, mb, is_streaming, self.buffer)
            if batch in events.closed:
                is_open = self.steps.is_open(batch)
                out += self.steps.closed_batch(batch)
                if not is_open and self.state.phase is Phase.WAITING and batch == self.state.step:
                    out += self._want_step(now)
        return out

    def _want_step(self, now: float) -> list[Command]:
        """Open step ``step`` now, or (whole-batch systems, and during the cold start) once its
        batch is complete; a synchronous step also waits for an evaluation to end (its engines
        are the trainer's GPUs)."""
        st, system, closed = self.state, self.config.system, self.steps.closed
        out: list[Command] = []
        if not self.rollout_ranks() and not system.is_sync:
            st.to(Phase.WAITING)
            out += self._check_rollout_left(-1, now)
            if st.step not in closed:
                return out
        is_eval_blocking = system.is_sync and bool(self.evaluation.in_flight)
        if st.hold is Hold.COLD_START and st.step in closed:
            return out + self._end_cold_start(now)
        if st.hold is not Hold.COLD_START and not is_eval_blocking \
                and (system.streams or st.step in closed):
            return out + self._open_step(now)
        st.to(Phase.WAITING)
        return out

    def _end_cold_start(self, now: float) -> list[Command]:
        """Batch 0 is ready: the ranks the cold start lent come back before step 0 opens (a
        boundary without an update; step 0 opens once it is acknowledged), so no batch trains
        on the trainer's minimum."""
        st = self.state
        st.set_hold(None)
        st.to(Phase.BOUNDARY)
        st.trainer_free_at = now  # the lent ranks rolled out until now: no trainer wait
        return self._plan(now, is_phase_over=True)

    def _open_step(self, now: float) -> list[Command]:
        """Step ``step`` opens: its micro-batches so far go out (first, for an attempt after a
        trainer rank died, the ones its failed attempt had)."""
        st, steps, is_sync = self.state, self.steps, self.config.system.is_sync
        st.to(Phase.TRAINING)
        start, st.placement = step_start(  # RA2P chooses on the TPRM of the arrivals so far
            st, self.config, self.tracker.signals(now), self.steps.passes, self.ledger.records,
            is_chosen_by_ra2p=self.ers is None and not self.manual.is_held)
        num_dp = max(1, len(start.actor_ranks) // self.config.tensor_parallel)
        self.buffer.num_dp_ranks = num_dp
        waiting = self.buffer.recut(st.step, steps.waiting.pop(st.step, []), num_dp)
        ready_at = now if is_sync else st.trainer_free_at  # sync: it was rolling out
        start, resent = steps.begin(start, now, ready_at, self.tracker,
                                    self.config.ra2p.max_aggregate)
        self.rollout.park(now, is_sync)
        out: list[Command] = [start, *(steps.send(mb) for mb in resent)]
        out += [steps.dispatch(mb, self.buffer) for mb in waiting]
        return out + steps.close_if_complete(st.step)

    # ------------------------------------------------------------------ faults

    def _run_again(self, now: float) -> list[Command]:
        """No live actor updated the step: it opens again with the micro-batches it had, after
        a boundary without an update when an actor died (the ranks left wrap their new actor
        set)."""
        st, retry = self.state, self.steps.run_again()
        if set(retry.start.actor_ranks) <= actors(st.roles, self.config.system.is_sync):
            st.to(Phase.WAITING)  # a Ref rank died
            return self._want_step(now)
        return self._boundary(now, st.roles, PlanReason.TRAINER_LOST)

    def _check_rollout_left(self, last: int, now: float) -> list[Command]:
        """No rollout rank is left (``last`` was the last; -1: not known): see
        :func:`.faults.rollout_left`."""
        st, buffer = self.state, self.buffer
        verdict = rollout_left(st, buffer, self.steps.current, self.config.system,
                               has_rollout=bool(self.rollout_ranks()))
        if verdict is NoRollout.SHRINK:
            return self._on_buffer(buffer.set_batch_size(st.step, buffer.assigned_samples, now),
                                   now)
        if verdict is NoRollout.MOVE_NOW:
            st.to(Phase.BOUNDARY)
            return self._boundary(now, st.roles, PlanReason.NO_ROLLOUT)
        current = self.steps.current
        if verdict is NoRollout.ABORT_STEP and current is not None and not current.is_aborted:
            current.is_aborted = True  # settled as RUN_AGAIN, which then moves a rank
            return [AbortStep(current.start.step, current.start.attempt)]
        return []
