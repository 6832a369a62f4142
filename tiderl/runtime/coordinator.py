"""The coordinator: dataset and groups, CTB, the global buffer, step control, ERS, metrics.

    dataset ──groups (up to the staleness throttle)──> TaskBook ──CTB round──> Admit / Pause /
    Resume / Detach ──bus──> rollout ranks ──TurnReport, TaskFinished──> TaskBook, groups
         group complete: GRPO advantages ──> ReadyBuffer ──micro-batches of batch s──> TrainStep s
         StepDone from every trainer rank of step s ──> boundary: version s+1, ERS plan,
         SyncWeights (roles + weight broadcast) to every live rank ──> step s+1

The policies are the core's (``TaskBook`` + ``make_policy``, ``ReadyBuffer``, ``ReadinessTracker``,
``choose_mode``, ``ERSPolicy``, ``group_advantages``), fed and applied the way the simulator does
(``tiderl.sim.cluster``); this module adds only the bus, the clock and the run folder. Time is
``time.monotonic()`` here and enters the core as ``now``.

Modes on one substrate: ``sync`` (every rank rolls out then trains, staleness 0, request-level
rollout, whole batches, colocated), ``async`` (fixed split, request-level, whole batches,
colocated), ``stream`` (fixed split, request-level, micro-batches streamed, VSO: a Ref/Actor
swap per micro-batch), ``tiderl`` (CTB, streamed micro-batches, RA2P's mode choice, ERS).

Split by concern: ranks, layout and the boundary in :mod:`tiderl.runtime.layout`, the metrics
in :mod:`tiderl.runtime.run_metrics`, manual plans (``tiderl rebalance``) in
:mod:`tiderl.runtime.manual`, the per-group and per-step state in :mod:`tiderl.runtime.records`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

from tiderl.core.buffer import ReadyBuffer
from tiderl.core.ctb import make_policy
from tiderl.core.ers import ERSPolicy
from tiderl.core.grpo import group_advantages
from tiderl.core.readiness import ReadinessTracker
from tiderl.core.types import Admit as AdmitDecision
from tiderl.core.types import (
    Group,
    MicroBatch,
    Mode,
    Ra2pTimings,
    Role,
    Task,
    Trajectory,
    Turn,
)
from tiderl.core.types import Pause as PauseDecision
from tiderl.core.types import Resume as ResumeDecision
from tiderl.profile import Profile
from tiderl.runtime import bus as b
from tiderl.runtime.bus import BusSendError, BusServer, HeartbeatMonitor, rank_identity
from tiderl.runtime.layout import LayoutMixin
from tiderl.runtime.manual import ManualMixin
from tiderl.runtime.records import CoordinatorError, GroupRun, StepRun
from tiderl.runtime.run_metrics import MetricsMixin
from tiderl.trainer.batch import TrainSample

log = logging.getLogger("tiderl.coordinator")

ROUND_S = 0.02  # bus poll / CTB round interval
SNAPSHOT_S = 0.5
HELLO_TIMEOUT_S = 600.0


class Coordinator(LayoutMixin, MetricsMixin, ManualMixin):
    def __init__(self, profile: Profile, run_dir: Path, server: BusServer,
                 roles: list[Role]) -> None:
        self.profile, self.run_dir, self.server = profile, run_dir, server
        rt = profile.runtime
        self.mode = rt.mode
        self.num_ranks = rt.num_ranks
        self.roles = list(roles)
        self.is_sync = self.mode == "sync"
        self.streams = self.mode in ("stream", "tiderl")
        self.max_staleness = 0 if self.is_sync else rt.max_staleness
        ctb = profile.ctb if self.mode == "tiderl" else replace(profile.ctb, policy="request")
        self.policy = make_policy(ctb)
        self.budget = ctb.rank_budget(profile.engine.kv_cache_tokens)
        self.batch_ideal = profile.ers.batch_ideal
        self.book = self.policy.config.new_book(max_staleness=self.max_staleness,
                                                tasks_per_step=self.batch_ideal)
        self.ers = ERSPolicy(profile.ers, profile.ra2p) if (
            self.mode == "tiderl" and profile.ers.enabled) else None
        self.clock = time.monotonic
        self.t0 = self.clock()
        self.tracker = ReadinessTracker(self.t0)
        self.buffer: ReadyBuffer[GroupRun] = ReadyBuffer(
            self.tracker, group_size=rt.group_size, batch_ideal=self.batch_ideal,
            max_staleness=self.max_staleness, tokens_per_rank=profile.ra2p.tokens_per_rank,
            on_micro_batch=self._on_micro_batch, on_batch_closed=self._on_batch_closed,
            on_group_dropped=self._on_group_dropped)
        self.heartbeats = HeartbeatMonitor(rt.heartbeat_s, rt.heartbeat_misses)
        self.seq = 0
        self.alive: set[int] = set()
        self.dead: set[int] = set()
        self.rollout_ready: set[int] = set()  # rollout ranks with an engine (in the book)
        self.pending_rollout: dict[int, int] = {}  # boundary seq -> rank joining rollout
        self.groups: dict[str, GroupRun] = {}
        self.task_rank: dict[str, int] = {}
        self.carries: dict[str, b.CarryData | None] = {}  # moved tasks: carry (None: restart)
        self.moves: dict[str, int] = {}  # task -> rank it goes to once its carry arrives
        self.num_fed = 0
        self.num_retired = 0
        # steps
        self.step = 0
        self.version = 0
        self.current: StepRun | None = None
        self.waiting: dict[int, list[MicroBatch]] = {}
        self.closed: set[int] = set()
        self.mb_samples: dict[str, TrainSample] = {}  # buffered samples by seq_id
        self.rewards: dict[str, float] = {}
        self.trained_groups: set[str] = set()
        self.num_dropped_groups = 0
        self.failed_samples = 0
        self.awaiting_close = False  # a whole-batch step waits for its batch
        self.syncing: dict[int, int] = {}  # SyncWeights seq -> rollout rank, until its Ack
        self.boundary_sent: dict[int, b.SyncWeights] = {}  # seq -> the boundary, until its Ack
        self.boundary_old_roles: list[Role] = list(roles)
        self.resent_versions: set[int] = set()
        self.superseded: set[int] = set()
        self.failed_boundaries: dict[int, tuple[b.SyncWeights, float, str]] = {}
        self._seq_rank: dict[int, int] = {}  # boundary seq -> the rank it went to
        self.step_wanted = False  # the next step opens once the boundary is taken
        self.retire_pending = False
        self.trainer_free_at = self.t0
        self.timings: dict[str, Ra2pTimings] = {}
        self.ra2p_mode = Mode.COLOCATED
        self.last_plan_reason: str | None = None
        self.eval_rewards: dict[int, list[float]] = {}
        self.eval_done: dict[int, float] = {}
        # metrics
        self.rank_metrics: dict[int, b.RankMetrics] = {}
        self.generated_tokens = 0
        self.rwt_s = 0.0
        self._rwt_at = self.clock()
        self.trained_tokens = 0
        self.trained_samples = 0
        self.records: list[dict] = []
        self.exporter = None  # Prometheus /metrics, set by the daemon (tiderl.runtime.prom)
        self.plan_note = ""  # a pending or the last manual plan (tiderl rebalance), for top
        self._init_manual()
        self._marks = self._counter_marks()
        self._last_snapshot = 0.0
        self.metrics_file = open(run_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self.events_file = open(run_dir / "events.jsonl", "a")  # noqa: SIM115

    # ---------------------------------------------------------------- helpers

    def now(self) -> float:
        return self.clock()

    def _elapsed(self) -> float:
        return self.now() - self.t0

    def event(self, kind: str, **fields) -> None:
        line = {"time_s": round(self._elapsed(), 3), "kind": kind, **fields}
        self.events_file.write(json.dumps(line) + "\n")
        self.events_file.flush()
        log.info("event %s", line)

    def _send(self, rank: int, msg: b.Message) -> None:
        if rank in self.dead:
            return
        try:
            self.server.send(rank_identity(rank), msg)
        except BusSendError as exc:  # its connection is gone: no need to wait for heartbeats
            log.warning("%s", exc)
            self._declare_dead(rank, "its bus connection is gone")

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _rollout_ranks(self) -> list[int]:
        return [r for r, role in enumerate(self.roles)
                if (role is Role.ROLLOUT or self.is_sync) and r not in self.dead]

    # ---------------------------------------------------------------- the run

    def run(self) -> dict:
        self._await_hellos()
        self.t0 = self._rwt_at = self.now()
        self.tracker.start_step(self.t0)
        self.trainer_free_at = self.t0
        self.event("launch", mode=self.mode, roles=[r.value for r in self.roles])
        if self.ers is not None:  # the launch plan: a cold start maximises rollout (§5.2)
            self._plan_ers(is_launch=True)
        joining = set(self.pending_rollout.values())
        for rank in self._rollout_ranks():
            if rank not in joining:  # a rank the launch plan moved joins once its engine is up
                self._add_rollout_rank(rank)
        self._feed()
        self._feed_eval()
        self.step_wanted = True
        self._maybe_start()
        while self.step < self.profile.runtime.steps:
            got = self.server.recv(ROUND_S)
            while got is not None:
                self._handle(*got)
                got = self.server.recv(0)
            self._schedule()
            self._integrate_rwt()
            self._check_heartbeats()
            if self.now() - self._last_snapshot >= SNAPSHOT_S:
                self._publish()
        self._finish()
        return self.records[-1] if self.records else {}

    def _await_hellos(self) -> None:
        deadline = self.now() + HELLO_TIMEOUT_S
        while len(self.alive) < self.num_ranks:
            if self.now() > deadline:
                missing = sorted(set(range(self.num_ranks)) - self.alive)
                raise CoordinatorError(f"ranks {missing} did not start within "
                                       f"{HELLO_TIMEOUT_S:.0f} s (see their logs)")
            got = self.server.recv(1.0)
            if got is not None:
                self._handle(*got)

    def _finish(self) -> None:
        for rank in range(self.num_ranks):
            self._send(rank, b.Shutdown(seq=self._next_seq(), reason="job done"))
        self.event("stop", reason="done", steps=self.step, groups=self._group_accounting())
        self._publish()

    def close(self) -> None:
        self.metrics_file.close()
        self.events_file.close()

    # ---------------------------------------------------------------- dataset

    def _task_text(self, env: str) -> str:
        return self.profile.env.tasks.get(env, "")

    def _new_group(self, group_id: str, index: int, is_eval: bool) -> GroupRun:
        envs = self.profile.env.envs
        env = envs[index % len(envs)]
        seed = self.profile.runtime.seed * 1_000_003 + index * 7919 + (500_009 if is_eval else 0)
        g = self.profile.runtime.group_size
        tasks = {f"{group_id}.{i}": Task(f"{group_id}.{i}", group_id, env, is_eval, None, seed)
                 for i in range(g)}  # one prompt (env seed) per group: GRPO's shared prompt
        run = GroupRun(group_id, tasks, self._task_text(env), is_eval, self.step)
        self.groups[group_id] = run
        self.book.add_group(Group(group_id, tuple(tasks.values())))
        return run

    def _feed(self) -> None:
        """Training groups up to the book's staleness throttle (as the simulator feeds)."""
        limit = self.book.train_admission_limit
        horizon = -(-limit // self.profile.runtime.group_size) if limit is not None else 0
        while self.num_fed < horizon:
            self._new_group(f"g{self.num_fed}", self.num_fed, is_eval=False)
            self.num_fed += 1

    def _feed_eval(self) -> None:
        every, count = self.profile.runtime.eval_every, self.profile.runtime.eval_groups
        if every and self.step % every == 0:
            self.eval_rewards[self.step] = []
            for i in range(count):
                self._new_group(f"e{self.step}.{i}", i, is_eval=True)
            self.event("eval_start", step=self.step, version=self.version, groups=count)

    def _is_eval_phase(self) -> bool:
        every = self.profile.runtime.eval_every
        return bool(every and self.step % every == 0) or any(
            g.is_eval for g in self.groups.values())

    # ---------------------------------------------------------------- CTB

    def _add_rollout_rank(self, rank: int) -> None:
        self.book.add_rank(rank, self.budget)
        self.rollout_ready.add(rank)

    def _schedule(self) -> None:
        decisions = self.policy.schedule(self.book)
        if not decisions:
            return
        self.book.apply(decisions)
        for d in decisions:
            if isinstance(d, AdmitDecision | ResumeDecision):  # its next generation starts now
                self.book.set_running(d.task_id, True)
            if isinstance(d, AdmitDecision):
                self._admit(d.task_id, d.rank)
            elif isinstance(d, PauseDecision):
                self._send(self.task_rank[d.task_id], b.PauseTask(seq=self._next_seq(),
                                                              task_id=d.task_id))
            elif isinstance(d, ResumeDecision):
                if self.task_rank.get(d.task_id) == d.rank and d.task_id not in self.carries:
                    self._send(d.rank, b.ResumeTask(seq=self._next_seq(), task_id=d.task_id))
                else:
                    self._move(d.task_id, d.rank)

    def _admit(self, task_id: str, rank: int, carry: b.CarryData | None = None) -> None:
        group = self.groups[self.book.tasks[task_id].group_id]
        spec = group.tasks[task_id]
        self.task_rank[task_id] = rank
        self._send(rank, b.AdmitTask(seq=self._next_seq(), task_id=task_id, group_id=group.group_id,
                                 env=spec.env, task=group.task_text, seed=spec.seed,
                                 eval=spec.is_eval, pin=self.policy.pins_tasks, carry=carry))

    def _move(self, task_id: str, rank: int) -> None:
        """Resume elsewhere: from its carry once the old rank has sent it (or from scratch when
        its rank died)."""
        if task_id in self.carries:
            self._admit(task_id, rank, self.carries.pop(task_id))
            return
        old = self.task_rank.get(task_id)
        self.moves[task_id] = rank
        if old is not None and old not in self.dead:
            self._send(old, b.DetachTask(seq=self._next_seq(), task_id=task_id))

    # ---------------------------------------------------------------- messages

    def _handle(self, identity: bytes, msg: b.Message) -> None:
        if isinstance(msg, b.Rebalance):  # a CLI peer: its CURVE key proved it is the job's
            self._on_rebalance(identity, msg)
            return
        rank = getattr(msg, "rank", None)
        if rank is None or identity != rank_identity(rank):
            log.warning("bus: dropped a %s from %r (not a rank message)", type(msg).__name__,
                        identity)
            return
        self.heartbeats.beat(rank, self.now())
        if isinstance(msg, b.Hello):
            self.alive.add(rank)
            log.info("rank %d up: pid %d on %s (%s, %s)", rank, msg.pid, msg.host, msg.role,
                     msg.device)
        elif isinstance(msg, b.TurnReport):
            self._on_turn(msg)
        elif isinstance(msg, b.TaskFinished):
            self._on_finished(msg)
        elif isinstance(msg, b.TaskDetached):
            self._on_detached(msg)
        elif isinstance(msg, b.StepDone):
            self._on_step_done(msg)
        elif isinstance(msg, b.RankMetrics):
            self.rank_metrics[rank] = msg
        elif isinstance(msg, b.Ack):
            self._on_ack(msg)
        elif not isinstance(msg, b.Heartbeat):
            log.warning("bus: rank %d sent a %s, which only the coordinator sends", rank,
                        type(msg).__name__)

    def _known(self, task_id: str) -> bool:
        return task_id in self.book.tasks

    def _on_turn(self, msg: b.TurnReport) -> None:
        if not self._known(msg.task_id):
            return
        if msg.running:  # the observation came back: the next generation starts
            self.book.set_running(msg.task_id, True)
            return
        self.generated_tokens += msg.tokens
        footprint = msg.context_tokens + self.profile.engine.max_new_tokens
        self.book.report_turn(msg.task_id, footprint, msg.context_tokens, is_running=False)

    def _on_finished(self, msg: b.TaskFinished) -> None:
        if not self._known(msg.task_id):
            return  # a task that was moved off a rank declared dead
        self.book.finish_task(msg.task_id)
        self.task_rank.pop(msg.task_id, None)
        group = self.groups[msg.group_id]
        turns = [Turn(t.context_ids, t.output_ids, t.logprobs, t.version) for t in msg.turns]
        group.finished[msg.task_id] = Trajectory(msg.task_id, msg.group_id, turns, msg.reward)
        if group.is_complete:
            self._on_group_complete(group)

    def _on_detached(self, msg: b.TaskDetached) -> None:
        if not self._known(msg.task_id):
            return
        target = self.moves.pop(msg.task_id, None)
        if target is not None and target in self.rollout_ready:
            self._admit(msg.task_id, target, msg.carry)
        else:
            self.carries[msg.task_id] = msg.carry

    def _on_group_complete(self, group: GroupRun) -> None:
        del self.groups[group.group_id]
        trajectories = list(group.finished.values())
        rewards = [t.reward or 0.0 for t in trajectories]
        if group.is_eval:
            self.eval_rewards.setdefault(group.step, []).extend(rewards)
            if not any(g.is_eval and g.step == group.step for g in self.groups.values()):
                mean = sum(self.eval_rewards[group.step]) / len(self.eval_rewards[group.step])
                self.eval_done[group.step] = mean
                versions = sorted({t.version for tr in trajectories for t in tr.turns})
                self.event("eval", step=group.step, reward=round(mean, 4), versions=versions)
            return
        if any(not t.turns for t in trajectories):
            self.num_dropped_groups += 1
            self.failed_samples += len(trajectories)  # out of the staleness window too
            self.event("dropped_group", group=group.group_id, reason="a task produced no turn")
            return
        advantages = group_advantages(rewards, self.profile.trainer.adv_eps)
        group.samples = [TrainSample.from_trajectory(t, a)
                         for t, a in zip(trajectories, advantages, strict=True)]
        for sample, trajectory in zip(group.samples, trajectories, strict=True):
            self.mb_samples[sample.seq_id] = sample
            self.rewards[sample.seq_id] = trajectory.reward or 0.0
        self.buffer.add_group(group, self.now())

    def _on_group_dropped(self, group: GroupRun) -> None:
        self.num_dropped_groups += 1
        for sample in group.samples:
            self.mb_samples.pop(sample.seq_id, None)
        self.event("dropped_group", group=group.group_id, reason="stale",
                   oldest_version=group.oldest_version, batch=self.buffer.open_batch)

    def _on_ack(self, msg: b.Ack) -> None:
        if msg.ref in self.superseded:
            return  # an answer to a boundary that was sent again without a dead member
        sent = self.boundary_sent.pop(msg.ref, None)
        self._seq_rank.pop(msg.ref, None)
        if not msg.ok:
            if sent is None:
                raise CoordinatorError(f"rank {msg.rank} failed: {msg.error}")
            # most likely a member died during the broadcast: its heartbeats will say which;
            # this answer's bookkeeping goes, the boundary will be sent again
            self.syncing.pop(msg.ref, None)
            self.pending_rollout.pop(msg.ref, None)
            self.superseded.add(msg.ref)
            deadline = self.now() + self._heartbeat_window()
            self.failed_boundaries.setdefault(sent.version, (sent, deadline, msg.error))
            self._check_failed_boundaries()
            return
        self._maybe_start()
        if self.syncing.pop(msg.ref, None) is not None:
            self._maybe_retire()
        rank = self.pending_rollout.pop(msg.ref, None)
        if rank is not None and self.roles[rank] is Role.ROLLOUT and rank not in self.dead:
            self._add_rollout_rank(rank)
            for task_id, target in list(self.moves.items()):
                if target == rank and task_id in self.carries:
                    del self.moves[task_id]
                    self._admit(task_id, rank, self.carries.pop(task_id))

    # ---------------------------------------------------------------- heartbeats

    # ---------------------------------------------------------------- the buffer and steps

    def _on_micro_batch(self, batch: int, mb: MicroBatch) -> None:
        if self.current is not None and batch == self.current.step and self.streams:
            self._dispatch(mb)
        else:
            self.waiting.setdefault(batch, []).append(mb)

    def _on_batch_closed(self, batch: int) -> None:
        if self.current is not None and batch == self.current.step:
            self._close_current()
            return
        self.closed.add(batch)
        if self.awaiting_close and batch == self.step:
            self._start_step()

    def _dispatch(self, mb: MicroBatch) -> None:
        step = self.current
        assert step is not None
        self.buffer.consume(step.step, mb)
        samples = [self.mb_samples.pop(s.seq_id) for s in mb.sequences]
        step.samples += samples
        data = [b.TrainSampleData(seq_id=s.seq_id, input_ids=list(s.input_ids),
                                  loss_mask=list(s.loss_mask), logprobs=list(s.logprobs),
                                  advantage=s.advantage, version=s.version) for s in samples]
        msg = b.MicroBatchData(seq=self._next_seq(), step=step.step, mb_id=step.num_mbs,
                               samples=data)
        step.num_mbs += 1
        for rank in step.ranks:
            self._send(rank, msg)

    def _dispatch_waiting(self) -> None:
        for mb in self.waiting.pop(self.step, []):
            self._dispatch(mb)

    def _close_current(self) -> None:
        step = self.current
        assert step is not None
        msg = b.StepClosed(seq=self._next_seq(), step=step.step)
        for rank in step.ranks:
            self._send(rank, msg)

    def _start_step(self) -> None:
        """Open step ``self.step``: its layout and mode, then what is ready of its batch."""
        if not self.streams and self.step not in self.closed:
            self.awaiting_close = True  # whole-batch modes: ``_on_batch_closed`` comes back
            return
        self.awaiting_close = False
        now = self.now()
        if self.step:
            self._feed_eval()
        self.tracker.start_step(now)
        mode, refs, actors = self._step_layout()
        self.buffer.num_dp_ranks = len(actors)
        self.current = StepRun(self.step, mode, refs, actors, now, self.trainer_free_at,
                               self.tracker.step_ras)
        msg = b.TrainStep(seq=self._next_seq(), step=self.step, mode=mode, ref_ranks=refs,
                          actor_ranks=actors,
                          max_aggregate=self.profile.ra2p.max_aggregate if mode == "colocated"
                          else 1)
        for rank in self.current.ranks:
            self._send(rank, msg)
        self._dispatch_waiting()
        if self.step in self.closed:
            self.closed.discard(self.step)
            self._close_current()

    def _on_step_done(self, msg: b.StepDone) -> None:
        step = self.current
        if step is None or msg.step != step.step:
            log.warning("rank %d reported step %d, not the open one", msg.rank, msg.step)
            return
        step.done[msg.rank] = msg
        if set(step.done) >= set(step.ranks):
            self._end_step()

    def _end_step(self) -> None:
        step = self.current
        assert step is not None
        now = self.now()
        self._learn_timings(step)
        record = self._record(step, now)
        self.records.append(record)
        self.current = None
        self.step += 1
        self.version += 1
        self.retire_pending = True
        if self.step >= self.profile.runtime.steps:
            self._write_record(record)
            self._boundary(checkpoint=True)
            return
        if not self._apply_manual():  # else an operator's plan (tiderl rebalance) took it
            if self.ers is not None and not self.manual_hold:
                self._plan_ers()
            else:
                self._boundary()
        self._write_record(record)
        self._maybe_retire()
        self.trainer_free_at = self.now()
        self.step_wanted = True
        self._maybe_start()

    def _maybe_start(self) -> None:
        """Open the next step once every live rank has taken the boundary: a TrainStep queued
        behind a broadcast that fails (a member died) would hold the ranks that must redo it."""
        if not self.step_wanted or self.boundary_sent:
            return
        self.step_wanted = False
        self._start_step()

    def _maybe_retire(self) -> None:
        """Move the staleness window once every rollout rank has the new version: admitting
        against the new window earlier would start tasks on the old weights (too stale to train
        by the time their batch comes)."""
        if not self.retire_pending or self.syncing:
            return
        self.retire_pending = False
        retired = self.trained_samples + self.buffer.discarded_samples + self.failed_samples
        self.book.retire(retired - self.num_retired)
        self.num_retired = retired
        self._feed()
