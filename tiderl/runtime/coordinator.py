"""The coordinator: an adapter between the bus and the core's step controller.

    rank daemons ──Hello / Heartbeat / TurnReport / TaskFinished / TaskDetached / StepDone /
                   StepFailed / RankMetrics / Ack──> _handle ──events──> StepController
    tiderl rebalance ──Rebalance──> RebalanceDesk ──> submit_manual / release_manual
    every round (ROUND_S): the messages that came, one CTB round, the heartbeats, a snapshot
    StepController commands ──> bus messages to the ranks:
        FeedGroups: the groups' tasks (Dataset)      CTB decisions: TaskRouter (admit, move, ...)
        StartStep / Dispatch / CloseStep / AbortStep: StepLink (TrainStep, MicroBatchData,
            StepClosed, AbortStep; StepDone and StepFailed back)
        Boundary: BoundaryLink (SyncWeights, resend without a dead member)
        RecordStep: RunLog (metrics.jsonl, /metrics, the PUB snapshot)

Every scheduling decision is the controller's, the same object the simulator drives; this module
adds the bus, the clock and the run folder: what the ranks sent in, what the commands mean as
messages, the samples' data, and the run's events. Time is ``clock()`` (monotonic by default) and
enters the controller as ``now``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from tiderl.core import commands as c
from tiderl.core.grpo import group_advantages
from tiderl.core.records import reward_summary
from tiderl.core.segments import task_of
from tiderl.core.step_control import StepController, restore, resume_point, task_id
from tiderl.core.types import Role, Trajectory
from tiderl.engine.config import SERVER_UP_TIMEOUT_S
from tiderl.env.client import EnvClientError, end_sessions_of
from tiderl.profile import Profile
from tiderl.runtime import bus as b
from tiderl.runtime.boundary import BoundaryLink
from tiderl.runtime.bus import BusSendError, BusServer, HeartbeatMonitor, rank_identity
from tiderl.runtime.rebalance import RebalanceDesk
from tiderl.runtime.records import CoordinatorError, Dataset, GroupRun
from tiderl.runtime.resume import (
    CHECKPOINTS,
    JobState,
    ReadyGroupState,
    prune,
    read_job_state,
    space_shortfall,
    write_job_state,
)
from tiderl.runtime.run_log import EventThrottle, RunLog
from tiderl.runtime.step_config import step_config
from tiderl.runtime.step_link import StepLink
from tiderl.runtime.tasks import TaskRouter
from tiderl.runtime.trajectory_wire import sample_data, sample_of, turn_of
from tiderl.trainer.checkpoint_meta import step_dir
from tiderl.trainer.sample import TrainSample

# A job whose tasks all fail (an environment or a model that cannot play them) stops with the
# reason after this many groups, instead of feeding new ones for ever.
MAX_FAILED_GROUPS_IN_A_ROW = 32
log = logging.getLogger("tiderl.coordinator")

ROUND_S = 0.02  # bus poll / CTB round interval
HELLO_TIMEOUT_S = 600.0
STALL_STOP_FACTOR = 3  # the job stops after this many watchdog windows without progress


class Coordinator:
    def __init__(self, profile: Profile, server: BusServer, roles: list[Role], run_log: RunLog,
                 clock: Callable[[], float] = time.monotonic, resume: Path | None = None,
                 env_url: str = "") -> None:
        """``resume``: the checkpoint folder a resumed job goes on from (None: a fresh job);
        ``env_url``: the environment service, where a dead rank's sessions are ended."""
        self.profile, self.server, self.log, self.clock = profile, server, run_log, clock
        self.resume_from, self.env_url = resume, env_url
        rt = profile.runtime
        self.dataset = Dataset(profile)
        self.controller = StepController(step_config(profile), roles, self.dataset.group,
                                         now=clock())
        self.heartbeats = HeartbeatMonitor(rt.heartbeat_s, rt.heartbeat_misses)
        self.alive: set[int] = set()
        self.unreachable: set[int] = set()  # a send found its bus connection gone
        self.announced: tuple[Role, ...] = ()  # the roles of the last boundary sent
        self.seq = 0
        self.groups: dict[str, GroupRun] = {}  # in flight, until complete
        self.router = TaskRouter(self._send, self._next_seq, self._group_of,
                                 lambda: self.controller.book.ranks,
                                 self.controller.rollout.policy.pins_tasks)
        window_s = rt.heartbeat_s * (rt.heartbeat_misses + 1)  # heartbeats name a dead rank
        self.link = BoundaryLink(self._send, self._next_seq, window_s)
        self.steps = StepLink(self._send, self._next_seq, window_s)
        self.desk = RebalanceDesk(server, self.log.event)
        self.samples: dict[str, TrainSample] = {}  # ready, not yet dispatched, by seq id
        self.rewards: dict[str, float] = {}
        self.eval_rewards: dict[int, list[float]] = {}
        self.eval_done: dict[int, float] = {}
        self.progress_at = clock()  # the last report of work done (the watchdog's)
        self.stalled_s = 0.0  # the watchdog's last alarm (0: none since the last progress)
        self.throttle = EventThrottle(run_log.event)
        self.is_finished = False
        self.failed_in_a_row = 0  # training groups dropped for a failed task since the last one
        self.last_task_error = ""  # the last task failure a rank reported, for the job's end

    # ---------------------------------------------------------------- the run

    def run(self) -> None:
        self._await_hellos()
        self.launch()
        while not self.is_finished:
            got = self.server.recv(ROUND_S)
            while got is not None and not self.is_finished:
                self.handle_safely(*got)
                got = self.server.recv(0)
            self.schedule_round()
            self.check_liveness()
            if self.log.is_snapshot_due():
                self._publish()
        self._finish()

    def launch(self) -> None:
        """Every rank said Hello: the job's clock starts and the controller launches it (or,
        resuming, goes on from its checkpoint)."""
        now = self.clock()
        self.progress_at = now
        if self.resume_from is not None:
            self._resume(self.resume_from, now)
            return
        self.log.t0 = now
        self.log.event("launch", mode=self.profile.runtime.mode,
                       roles=[r.value for r in self.controller.roles])
        self._apply(self.controller.launch(now))

    def _resume(self, folder: Path, now: float) -> None:
        """The checkpoint's ready groups come back with their samples; its groups in flight
        run again (tiderl.core.step_control.resume says why)."""
        state = read_job_state(folder)
        ready = []
        for group in state.ready:
            run = self.dataset.run(c.GroupSpec(group.group_id, group.index, False, group.step))
            run.samples = [sample_of(d) for d in group.samples]
            for sample, reward in zip(run.samples, group.rewards, strict=True):
                self.samples[sample.seq_id] = sample
                self.rewards[sample.seq_id] = reward
            ready.append(run)
        point = state.point
        self.log.t0 = now - point.elapsed_s
        self.log.event("resume", version=point.version, elapsed_s=round(point.elapsed_s, 3),
                       checkpoint=str(folder),
                       roles=[r.value for r in point.roles],
                       ready=[g.group_id for g in state.ready],
                       rerun=[s.group_id for s in point.in_flight])
        self._apply(restore(self.controller, point, ready, now))

    def schedule_round(self) -> None:
        """One CTB round, its decisions sent to the ranks."""
        self.router.apply(self.controller.schedule(self.clock()))

    def _await_hellos(self) -> None:
        num_ranks = len(self.controller.roles)
        timeout = HELLO_TIMEOUT_S + (SERVER_UP_TIMEOUT_S if self.profile.engine.uses_server
                                     else 0.0)  # a rank says Hello once its server is up
        deadline = self.clock() + timeout
        while len(self.alive) < num_ranks:
            if self.clock() > deadline:
                missing = sorted(set(range(num_ranks)) - self.alive)
                raise CoordinatorError(f"ranks {missing} did not start within "
                                       f"{timeout:.0f} s (see their logs)")
            got = self.server.recv(1.0)
            if got is not None:
                self.handle_safely(*got)

    def _finish(self) -> None:
        for rank in range(len(self.controller.roles)):
            self._send(rank, b.Shutdown(seq=self._next_seq(), reason="job done"))
        self.log.event("stop", reason="done", state="ok", steps=self.controller.step,
                       groups=self.controller.feed.count.as_dict())
        self._publish()

    def _publish(self) -> None:
        self.server.publish(self.log.snapshot(self.controller, self.desk.note))

    def _send(self, rank: int, msg: b.Message) -> None:
        if rank in self.controller.dead or rank in self.unreachable:
            return
        try:
            self.server.send(rank_identity(rank), msg)
        except BusSendError as exc:  # its connection is gone: no need to wait for heartbeats
            log.warning("%s", exc)
            # declared dead at the round's liveness check, not amid the commands being applied
            # (its death may send a boundary again, which must not cut into this one)
            self.unreachable.add(rank)

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _group_of(self, task: str) -> GroupRun:
        return self.groups[self.controller.book.tasks[task].group_id]

    # ---------------------------------------------------------------- messages in

    def handle_safely(self, identity: bytes, msg: b.Message) -> None:
        """:meth:`handle`, surviving any error but the job's own end: the message is dropped
        with an event (one a minute per kind of failure, with a count)."""
        try:
            self.handle(identity, msg)
        except CoordinatorError:
            raise
        except Exception as exc:  # the loop must outlive any one message
            log.exception("handling a %s from %r failed", type(msg).__name__, identity)
            self.throttle.event("handler_error", f"{type(msg).__name__}/{type(exc).__name__}",
                                message=type(msg).__name__, error=f"{exc}"[:300])

    def handle(self, identity: bytes, msg: b.Message) -> None:
        now = self.clock()
        if isinstance(msg, b.Rebalance):  # a CLI peer: its CURVE key proved it is the job's
            self._apply(self.desk.request(identity, msg, self.controller, now))
            return
        rank = getattr(msg, "rank", None)
        if rank is None or identity != rank_identity(rank) or \
                not 0 <= rank < len(self.controller.roles):
            self.throttle.event("message_dropped", f"{type(msg).__name__}/{identity!r}",
                                message=type(msg).__name__, sender=repr(identity)[:80],
                                why="not a rank of this job")
            return
        if rank in self.controller.dead:  # declared dead (stopped too long): it goes for good
            self._stop_zombie(rank, msg)
            return
        self.heartbeats.beat(rank, now)
        if isinstance(msg, b.TurnReport | b.TaskFinished | b.StepDone | b.StepFailed | b.Ack):
            self.progress_at, self.stalled_s = now, 0.0
        rollout = self.controller.rollout
        if isinstance(msg, b.Hello):
            self.alive.add(rank)
            log.info("rank %d up: pid %d on %s (%s, %s)", rank, msg.pid, msg.host, msg.role,
                     msg.device)
        elif isinstance(msg, b.TurnReport):
            if msg.running:  # the observation came back: the next generation starts
                rollout.turn_started(msg.task_id, now)
            elif not msg.done:  # the generation ended: the task waits for its environment
                rollout.turn_done(msg.task_id, msg.context_tokens, msg.tokens, now)
        elif isinstance(msg, b.TaskFinished):
            self._on_finished(msg, now)
        elif isinstance(msg, b.TaskDetached):
            if rollout.is_known(msg.task_id):
                self.router.on_detached(msg)
        elif isinstance(msg, b.StepDone | b.StepFailed):
            self._on_step_report(msg, now)
        elif isinstance(msg, b.RankMetrics):
            self.log.rank_metrics[rank] = msg
            if msg.kv_tokens_capacity:  # what the engine (a server sizes its own) holds
                self._apply(self.controller.engine_capacity(rank, msg.kv_tokens_capacity, now))
        elif isinstance(msg, b.Ack):
            acked = self.link.on_ack(msg, now)
            if acked is not None:
                self._apply(self.controller.boundary_acked(*acked, now))
            self._check_boundaries(now)
        elif not isinstance(msg, b.Heartbeat):
            log.warning("bus: rank %d sent a %s, which only the coordinator sends", rank,
                        type(msg).__name__)

    def _stop_zombie(self, rank: int, msg: b.Message) -> None:
        """A rank declared dead speaks again (a SIGSTOP longer than the heartbeats allow, then
        SIGCONT): its tasks went elsewhere, so nothing it says counts; it is told to exit."""
        self.throttle.event("message_dropped", f"dead/{rank}", message=type(msg).__name__,
                            sender=f"rank {rank}", why="the rank was declared dead")
        with contextlib.suppress(BusSendError):  # gone for good already
            self.server.send(rank_identity(rank), b.Shutdown(
                seq=self._next_seq(), reason="this rank was declared dead"))

    def _on_finished(self, msg: b.TaskFinished, now: float) -> None:
        group = self.groups.get(msg.group_id)
        if group is None or msg.task_id not in group.tasks or \
                not self.controller.rollout.task_finished(msg.task_id, now):
            # not a task in flight here: one moved off a rank declared dead, or a bogus one
            self.throttle.event("message_dropped", f"TaskFinished/{msg.rank}",
                                message="TaskFinished", sender=f"rank {msg.rank}",
                                why=f"task {msg.task_id[:40]!r} is not in flight")
            return
        self.router.on_finished(msg.task_id)
        if msg.error:
            self.last_task_error = f"task {msg.task_id} on rank {msg.rank}: {msg.error}"
        group.finished[msg.task_id] = Trajectory(msg.task_id, msg.group_id,
                                                 [turn_of(t) for t in msg.turns], msg.reward,
                                                 dict(msg.image_data))
        if group.is_complete:
            del self.groups[group.group_id]
            self._on_group_complete(group, now)

    def _on_group_complete(self, group: GroupRun, now: float) -> None:
        trajectories = [group.finished[task] for task in group.tasks]  # in task order
        rewards = [t.reward or 0.0 for t in trajectories]
        if group.is_eval:
            self._on_eval_group(group, trajectories, rewards)
            ready = None
        elif any(not t.turns for t in trajectories):
            ready = None  # a task produced no turn: the group cannot be trained
            self.failed_in_a_row += 1
            if self.failed_in_a_row >= MAX_FAILED_GROUPS_IN_A_ROW:
                raise CoordinatorError(
                    f"{self.failed_in_a_row} groups in a row had a task that failed, so "
                    f"nothing can train; the last: {self.last_task_error or 'no turn played'}")
        else:
            self.failed_in_a_row = 0
            advantages = group_advantages(rewards, self.profile.trainer.adv_eps)
            for trajectory, advantage, reward in zip(trajectories, advantages, rewards,
                                                     strict=True):
                for sample in TrainSample.from_trajectory(trajectory, advantage,
                                                          trajectory.image_data):
                    group.samples.append(sample)
                    self.samples[sample.seq_id] = sample
                    self.rewards[sample.seq_id] = reward
            ready = group
        self._apply(self.controller.group_ready(group.group_id, ready, now))

    def _on_eval_group(self, group: GroupRun, trajectories: list[Trajectory],
                       rewards: list[float]) -> None:
        self.eval_rewards.setdefault(group.step, []).extend(rewards)
        if not any(g.is_eval and g.step == group.step for g in self.groups.values()):
            mean = sum(self.eval_rewards[group.step]) / len(self.eval_rewards[group.step])
            self.eval_done[group.step] = mean
            versions = sorted({t.version for tr in trajectories for t in tr.turns})
            self.log.event("eval", step=group.step, reward=round(mean, 4), versions=versions)

    def _on_step_report(self, msg: b.StepDone | b.StepFailed, now: float) -> None:
        if not self.steps.is_of_open_attempt(msg):
            self.throttle.event("message_dropped", f"{type(msg).__name__}/{msg.rank}",
                                message=type(msg).__name__, sender=f"rank {msg.rank}",
                                why=f"step {msg.step} (attempt {msg.attempt}) is not open")
            return
        if isinstance(msg, b.StepDone):
            self.steps.on_done(msg)
        else:
            log.warning("rank %d: step %d (attempt %d) failed: %s", msg.rank, msg.step,
                        msg.attempt, msg.error)
            self.steps.on_failed(msg, now)
        self._check_step(now)

    def _check_step(self, now: float) -> None:
        """Every live rank of the open attempt answered: the controller settles the step (it
        trained, or it runs again without a dead rank)."""
        reports = self.steps.complete(self.controller.dead, now)
        if reports is None:
            return
        start = self.steps.start
        assert start is not None
        queries, hits = self.log.kv_counters()
        # the latest evaluation done since the last step's record goes into this one's
        eval_reward = self.eval_done[max(self.eval_done)] if self.eval_done else None
        reward_mean, solved_frac = reward_summary(self.steps.rewards)
        outcome = c.StepOutcome(start.step, reports, kv_queries=queries, kv_hits=hits,
                                reward_mean=reward_mean, solved_frac=solved_frac,
                                eval_reward=eval_reward)
        commands = self.controller.step_done(outcome, now)
        if any(isinstance(command, c.RecordStep) for command in commands):
            self.eval_done.clear()
            groups = self.steps.done()
            self.log.event("trained", step=start.step, attempt=start.attempt,
                           groups=sorted(groups, key=lambda g: (len(g), g)))
        else:  # a trainer rank died in it: it runs again (or the job stops)
            self.steps.reopen()
        self._apply(commands)

    # ---------------------------------------------------------------- liveness

    def check_liveness(self) -> None:
        """Ranks silent too long are dead; a broadcast one of them died in goes out again."""
        now = self.clock()
        unreachable, self.unreachable = self.unreachable, set()
        silent = [r for r in self.heartbeats.dead(now) if r not in unreachable]
        gone = self.controller.dead | unreachable | set(silent)
        if (unreachable or silent) and len(gone) == len(self.controller.roles):
            raise CoordinatorError(f"every rank is gone (ranks {sorted(unreachable | set(silent))}"
                                   " missed their heartbeats or lost their bus connection)")
        for rank in sorted(unreachable):
            self._declare_dead(rank, "its bus connection is gone")
        for rank in silent:
            self._declare_dead(rank, "missed heartbeats")
        self._check_boundaries(now)
        self._check_step(now)  # a dead rank's answer will not come; a failure may be explained
        self._check_progress(now)

    def watchdog_s(self) -> float:
        """How long the job may go without a report of work done before the watchdog speaks:
        ``runtime.watchdog_factor`` mean step times, at least ``runtime.watchdog_s``, and more
        than a collective may block when a member died in it (the broadcast then fails after
        ``collective_timeout_s`` and goes out again without it: that is progress to come)."""
        rt, records = self.profile.runtime, self.controller.records
        mean = records[-1].end_s / len(records) if records else 0.0
        return max(rt.watchdog_s, rt.watchdog_factor * mean,
                   rt.collective_timeout_s + self.link.window_s)

    def _check_progress(self, now: float) -> None:
        """No turn, task, step or acknowledgement for a watchdog window: an event naming what
        the step cycle waits for; after STALL_STOP_FACTOR windows the job stops (it resumes
        from its last checkpoint), never a silent hang."""
        idle, window = now - self.progress_at, self.watchdog_s()
        if idle < window or idle - self.stalled_s < window:
            return
        self.stalled_s = idle
        ctl = self.controller
        pending = ctl.boundaries.pending
        waits = {"phase": ctl.phase.value, "step": ctl.step, "tasks_new": ctl.book.num_new,
                 "tasks_active": ctl.book.num_active, "tasks_paused": ctl.book.num_paused,
                 "rollout_ranks": ctl.rollout_ranks(),
                 "awaiting": sorted(pending.awaiting) if pending else []}
        self.log.event("watchdog", idle_s=round(idle, 1), window_s=round(window, 1), **waits)
        log.error("no progress for %.0f s (%s)", idle, waits)
        if idle >= STALL_STOP_FACTOR * window:
            raise CoordinatorError(f"no progress for {idle:.0f} s (the step cycle is in phase "
                                   f"{ctl.phase.value} at step {ctl.step})")

    def _check_boundaries(self, now: float) -> None:
        for version in self.link.check(self.controller.dead, now):
            self.log.event("boundary_resent", version=version,
                           members=[r for r in range(len(self.controller.roles))
                                    if r not in self.controller.dead])

    def _declare_dead(self, rank: int, why: str) -> None:
        if rank in self.controller.dead:
            return
        self.log.event("rank_dead", rank=rank, role=self.controller.roles[rank].value, why=why)
        self.link.forget(rank)
        self._end_sessions_of(rank)
        self._apply(self.controller.rank_dead(rank, why, self.clock()))

    def _end_sessions_of(self, rank: int) -> None:
        """The environment sessions of a dead rank's tasks end now (their tasks start again
        elsewhere), instead of holding the service's table until they expire. One bounded
        call; a service that does not answer leaves them to expire."""
        if not self.env_url:
            return
        try:
            ended = end_sessions_of(self.env_url, rank_identity(rank).decode())
        except EnvClientError as exc:
            self.log.event("env_sessions_ended", rank=rank, ended=None, error=str(exc)[:200])
            return
        self.log.event("env_sessions_ended", rank=rank, ended=ended)

    # ---------------------------------------------------------------- commands out

    def _apply(self, commands: list[c.Command]) -> None:
        for command in commands:
            if isinstance(command, c.StartStep | c.Dispatch | c.CloseStep | c.AbortStep):
                self.steps.send(command, self.samples, self.rewards, self.controller.dead)
            elif isinstance(command, c.FeedGroups):
                self._feed(command)
            elif isinstance(command, c.JoinRollout):
                self.router.on_joined(command.rank)
            elif isinstance(command, c.LeaveRollout):
                self.router.on_left(command.rank, command.task_ids, command.is_dead,
                                    self.controller.rollout.is_known)
            elif isinstance(command, c.RecordStep):
                self.server.publish(self.log.record(command.record, self.controller,
                                                    self.desk.note))
            elif isinstance(command, c.Boundary):
                self._boundary(command)
            elif isinstance(command, c.GroupDropped):
                self._dropped(command)
            elif isinstance(command, c.PlanRefused):
                self.log.event("plan_refused", reason=command.reason,
                               reason_plan=command.plan_reason.value)
            elif isinstance(command, c.ManualReply):
                self.desk.deliver(command)
            elif isinstance(command, c.Finish):
                self.is_finished = True
            elif isinstance(command, c.Abort):
                raise CoordinatorError(command.reason)

    def _feed(self, command: c.FeedGroups) -> None:
        for spec in command.groups:
            self.groups[spec.group_id] = self.dataset.run(spec)
        if command.is_eval:
            step = command.groups[0].step
            self.eval_rewards[step] = []
            self.log.event("eval_start", step=step, version=self.controller.version,
                           groups=len(command.groups))

    def _boundary(self, boundary: c.Boundary) -> None:
        root = self.log.run_dir / CHECKPOINTS
        if boundary.checkpoint:  # job.json first: the actors' meta.json completes the folder
            folder = step_dir(root, boundary.version)
            for old in prune(root, self.profile.runtime.checkpoint_keep,
                             self.profile.trainer.tensor_parallel, folder):
                log.info("removed checkpoint %s", old)
            shortfall = space_shortfall(root, folder)
            if shortfall:  # stop before the actors fill the disk mid-save
                raise CoordinatorError(f"no disk space for checkpoint {folder.name}: "
                                       f"{shortfall}")
            write_job_state(folder, self._job_state())
        # against the layout last announced: a boundary sent again announces nothing twice,
        # and a death is its rank_dead event
        before, self.announced = self.announced or boundary.old_roles, boundary.roles
        for rank, (src, dst) in enumerate(zip(before, boundary.roles, strict=True)):
            if src is not dst and Role.IDLE not in (src, dst):
                self.log.event("role_change", rank=rank, src=src.value, dst=dst.value,
                               step=self.controller.step, version=boundary.version,
                               reason=boundary.reason.value if boundary.reason else None)
        self.link.send(boundary, str(root), str(self.log.run_dir / "hf"))

    def _job_state(self) -> JobState:
        point = resume_point(self.controller, self.clock())
        ready = []
        for group_id in point.ready:
            ids = self._group_seqs(group_id)
            ready.append(ReadyGroupState(group_id, int(group_id[1:]), 0,
                                         [sample_data(self.samples[i]) for i in ids],
                                         [self.rewards[i] for i in ids]))
        return JobState(point, ready)

    def _group_seqs(self, group_id: str) -> list[str]:
        """The ready training sequences of a group's tasks (a task's segments included), in
        task order."""
        tasks = {task_id(group_id, i) for i in range(self.profile.job.group_size)}
        return [seq for seq in self.samples if task_of(seq) in tasks]

    def _dropped(self, command: c.GroupDropped) -> None:
        for seq in self._group_seqs(command.group_id):
            self.samples.pop(seq, None)
            self.rewards.pop(seq, None)
        fields = {"oldest_version": command.oldest_version, "batch": command.batch} \
            if command.reason is c.DropReason.STALE else {}
        self.log.event("dropped_group", group=command.group_id, reason=command.reason.value,
                       **fields)
