"""The coordinator: an adapter between the bus and the core's step controller.

    rank daemons ──Hello / Heartbeat / TurnReport / TaskFinished / TaskDetached / StepDone /
                   StepFailed / RankMetrics / Ack──> handle ──events──> StepController
    tiderl rebalance ──Rebalance──> RebalanceDesk ──> submit_manual / release_manual
    every round (ROUND_S): the messages that came, one CTB round, the liveness check, a snapshot
    StepController commands ──> bus messages to the ranks:
        FeedGroups: the groups' tasks (GroupStore)   CTB decisions: TaskRouter (admit, move, ...)
        StartStep / Dispatch / CloseStep / AbortStep: StepLink (TrainStep, MicroBatchData,
            StepClosed, AbortStep; StepDone and StepFailed back)
        Boundary: BoundaryLink (SyncWeights with the source's feed address), the checkpoint's
            job state (and, after the commands with it, its `checkpoint` event: where a resume
            from it cuts events.jsonl, runtime/lineage.py)
        RecordStep: RunLog (metrics.jsonl, /metrics, the PUB snapshot)

Its parts: RankMail (sends), Liveness (heartbeats, the watchdog), GroupStore (groups in flight,
ready samples) and the links above. Every scheduling decision is the controller's, the object
the simulator drives too (a replay's follows its recording: :mod:`.replay`); this module adds
the bus, the clock (``now``) and the run folder.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from tiderl.core import commands as c
from tiderl.core.quote import cut, short
from tiderl.core.step_control import restore, resume_point
from tiderl.core.types import Role
from tiderl.engine.config import SERVER_UP_TIMEOUT_S
from tiderl.profile import Profile
from tiderl.runtime import bus as b
from tiderl.runtime import resume as checkpoints
from tiderl.runtime.boundary import BoundaryLink
from tiderl.runtime.bus import BusSendError, BusServer, rank_identity
from tiderl.runtime.errors import CoordinatorError
from tiderl.runtime.groups import GroupRun, GroupStore
from tiderl.runtime.liveness import Liveness, RankMail, end_sessions
from tiderl.runtime.rebalance import RebalanceDesk
from tiderl.runtime.replay import step_controller
from tiderl.runtime.run_log import RunLog
from tiderl.runtime.step_link import StepLink
from tiderl.runtime.task_router import TaskRouter

log = logging.getLogger("tiderl.coordinator")

ROUND_S, HELLO_TIMEOUT_S = 0.02, 600.0  # bus poll and CTB round interval; ranks' start-up


class Coordinator:
    def __init__(self, profile: Profile, server: BusServer, roles: list[Role], run_log: RunLog,
                 clock: Callable[[], float] = time.monotonic, resume: Path | None = None,
                 env_url: str = "") -> None:
        """``resume``: the checkpoint folder a resumed job goes on from (None: a fresh job);
        ``env_url``: the environment service, where a dead rank's sessions are ended."""
        self.profile, self.log, self.clock = profile, run_log, clock
        self.resume_from, self.env_url = resume, env_url
        self.store = GroupStore(profile)
        self.controller = step_controller(profile, roles, self.store, clock())  # or a replay's
        self.mail = RankMail(server)
        self.liveness = Liveness(profile, clock())
        window_s = self.liveness.window_s  # how long heartbeats take to name a dead rank
        self.router = TaskRouter(self._send, self.mail.next_seq, self._group_of,
                                 lambda: self.controller.rollout.book.ranks,
                                 self.controller.rollout.policy.pins_tasks)
        self.link = BoundaryLink(self._send, self.mail.next_seq, window_s, run_log.event)
        self.steps = StepLink.of(profile, run_log.run_dir, self._send, self.mail.next_seq, window_s)
        self.desk = RebalanceDesk(server, self.log.event)
        self.is_finished = False

    # ---------------------------------------------------------------- the run

    def run(self) -> None:
        self._await_hellos()
        self.launch()
        server = self.mail.server
        while not self.is_finished:
            got = server.recv(ROUND_S)
            while got is not None and not self.is_finished:
                self.handle_safely(*got)
                got = None if self.is_finished else server.recv(0)  # an Ack stays queued
            self.schedule_round()
            self.check_liveness()
            if self.log.is_snapshot_due():
                self._publish()
        while self.link.sent:  # the last boundary: every live rank fetches from its source
            got = server.recv(ROUND_S)  # before the source stops (and the ranks with it)
            if got is not None and isinstance(got[1], b.Ack | b.Heartbeat):
                self.handle_safely(*got)
            self.check_liveness()
        self._finish()

    def launch(self) -> None:
        """Every rank said Hello: the job's clock starts and the controller launches it (or,
        resuming, goes on from its checkpoint: its ready groups come back with their samples,
        its groups in flight run again, as tiderl.core.step_control.resume says why)."""
        now = self.clock()
        self.liveness.progress_at = now
        if self.resume_from is None:
            self.log.t0 = now
            self.log.event("launch", system=self.profile.runtime.system,
                           roles=[r.value for r in self.controller.state.roles])
            self._apply(self.controller.launch(now))
            return
        state = checkpoints.read_checkpoint_state(self.resume_from)
        point = state.point
        self.log.t0 = now - point.elapsed_s
        self.log.event("resume", version=point.version, elapsed_s=round(point.elapsed_s, 3),
                       checkpoint=str(self.resume_from), roles=[r.value for r in point.roles],
                       ready=[g.group_id for g in state.ready],
                       rerun=[s.group_id for s in point.in_flight],
                       metrics_lines=self.log.num_prior_records)  # the cut: runtime/lineage.py
        self._apply(restore(self.controller, point, self.store.restore(state.ready), now))

    def schedule_round(self) -> None:
        """One CTB round, its decisions sent to the ranks."""
        self.router.apply(self.controller.schedule(self.clock()))

    def _await_hellos(self) -> None:
        num_ranks = len(self.controller.state.roles)
        timeout = HELLO_TIMEOUT_S + (SERVER_UP_TIMEOUT_S if self.profile.engine.uses_server
                                     else 0.0)  # a rank says Hello once its server is up
        deadline = self.clock() + timeout
        while len(self.liveness.alive) < num_ranks:
            if self.clock() > deadline:
                missing = sorted(set(range(num_ranks)) - self.liveness.alive)
                raise CoordinatorError(f"ranks {missing} did not start within "
                                       f"{timeout:.0f} s (see their logs)")
            got = self.mail.server.recv(1.0)
            if got is not None:
                self.handle_safely(*got)

    def _finish(self) -> None:
        for rank in range(len(self.controller.state.roles)):
            self._send(rank, b.Shutdown(seq=self.mail.next_seq(), reason="job done"))
        self.log.event("stop", reason="done", state="ok", steps=self.controller.state.step,
                       groups=self.controller.feed.count.as_dict())
        self._publish()

    def _publish(self) -> None:
        self.mail.server.publish(self.log.snapshot(self.controller, self.desk.note))

    def _send(self, rank: int, msg: b.Message) -> None:
        self.mail.send(rank, msg, self.controller.state.dead)

    def _group_of(self, task: str) -> GroupRun:  # a task's group: CTB's book knows it
        return self.store.in_flight[self.controller.rollout.book.tasks[task].group_id]

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
            self.log.throttle.event("handler_error",
                                    f"{type(msg).__name__}/{type(exc).__name__}",
                                    message=type(msg).__name__, error=cut(str(exc), 300))

    def handle(self, identity: bytes, msg: b.Message) -> None:
        now, ctl = self.clock(), self.controller
        if isinstance(msg, b.Rebalance):  # a CLI peer: its CURVE key proved it is the job's
            self._apply(self.desk.request(identity, msg, ctl, now))
            return
        rank = getattr(msg, "rank", None)
        if rank is None or identity != rank_identity(rank) or not 0 <= rank < len(ctl.state.roles):
            self._dropped_message(msg, repr(identity), "not a rank of this job",
                                  key=f"{type(msg).__name__}/{identity!r}")
            return
        if rank in ctl.state.dead:  # declared dead (stopped too long): it goes for good
            self._dropped_message(msg, f"rank {rank}", "the rank was declared dead",
                                  key=f"dead/{rank}")
            with contextlib.suppress(BusSendError):  # gone for good already
                self.mail.server.send(rank_identity(rank), b.Shutdown(
                    seq=self.mail.next_seq(), reason="this rank was declared dead"))
            return
        self.liveness.heard(rank, msg, now)
        if isinstance(msg, b.Hello):
            self.link.feeds[rank] = msg.feed
            log.info("rank %d up: pid %d on %s (%s, %s)", rank, msg.pid, msg.host, msg.role,
                     msg.device)
        elif isinstance(msg, b.TurnReport):
            if msg.running:  # the observation came back: the next generation starts
                ctl.rollout.turn_started(msg.task_id, now)
            elif not msg.done:  # the generation ended: the task waits for its environment
                ctl.rollout.turn_done(msg.task_id, msg.context_tokens, msg.tokens, now,
                                      reused=msg.reused_tokens, reusable=msg.reusable_tokens)
        elif isinstance(msg, b.TaskFinished):
            self._on_finished(msg, now)
        elif isinstance(msg, b.TaskDetached):
            if ctl.rollout.is_known(msg.task_id):
                log.info("task %s left rank %d after %d turns: it goes on on another rank",
                         msg.task_id, rank, len(msg.carry.turns))
                self.router.on_detached(msg)
        elif isinstance(msg, b.StepDone | b.StepFailed):
            self._on_step_report(msg, now)
        elif isinstance(msg, b.RankMetrics):
            self.log.rank_metrics[rank] = msg
            if msg.kv_tokens_capacity:  # what the engine (a server sizes its own) holds
                self._apply(ctl.engine_capacity(rank, msg.kv_tokens_capacity, now,
                                                msg.prefill_tokens_per_s))
        elif isinstance(msg, b.Ack):
            acked = self.link.on_ack(msg, now)
            if acked is not None:
                self._apply(ctl.boundary_acked(*acked, now))
            self.link.check(now)
        elif not isinstance(msg, b.Heartbeat):
            log.warning("bus: rank %d sent a %s, which only the coordinator sends", rank,
                        type(msg).__name__)

    def _dropped_message(self, msg: b.Message, sender: str, why: str, key: str = "") -> None:
        """An event for a message that counts for nothing (one a minute per ``key``)."""
        kind = type(msg).__name__
        self.log.throttle.event("message_dropped", key or f"{kind}/{sender}", message=kind,
                                sender=cut(sender, 80), why=cut(why))

    def _on_finished(self, msg: b.TaskFinished, now: float) -> None:
        if not self.store.is_in_flight(msg.group_id, msg.task_id) or \
                not self.controller.rollout.task_finished(msg.task_id, now):
            # not a task in flight here: one moved off a rank declared dead, or a bogus one
            self._dropped_message(msg, f"rank {msg.rank}", f"task {short(msg.task_id, 40)} is not "
                                  "in flight", key=f"TaskFinished/{msg.rank}")
            return
        self.router.on_finished(msg.task_id)
        group = self.store.finished(msg)
        if group is None:
            return
        ready = self.store.complete(group)
        if group.is_eval and self.store.evaluation_ended(group.step):
            versions = sorted({t.version for tr in group.finished.values() for t in tr.turns})
            self.log.event("eval", step=group.step,
                           reward=round(self.store.eval_done[group.step], 4), versions=versions)
        self._apply(self.controller.group_ready(group.group_id, ready, now))

    def _on_step_report(self, msg: b.StepDone | b.StepFailed, now: float) -> None:
        if not self.steps.is_of_open_attempt(msg):
            self._dropped_message(msg, f"rank {msg.rank}", f"step {msg.step} (attempt "
                                  f"{msg.attempt}) is not open",
                                  key=f"{type(msg).__name__}/{msg.rank}")
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
        store = self.store
        # the latest evaluation done since the last step's record goes into this one's
        eval_reward = store.eval_done[max(store.eval_done)] if store.eval_done else None
        outcome = self.steps.outcome(self.controller.state.dead, now, self.log.kv_counters(),
                                     eval_reward)
        if outcome is None:
            return
        start = self.steps.start
        assert start is not None
        commands = self.controller.step_done(outcome, now)
        if any(isinstance(command, c.RecordStep) for command in commands):
            store.eval_done.clear()
            groups = self.steps.done()
            self.log.event("trained", step=start.step, attempt=start.attempt,
                           groups=sorted(groups, key=lambda g: (len(g), g)))
        else:  # a trainer rank died in it: it runs again (or the job stops)
            self.steps.reopen()
        self._apply(commands)

    # ---------------------------------------------------------------- liveness

    def check_liveness(self) -> None:
        """Ranks silent too long are dead (a boundary or a step goes on without them)."""
        now = self.clock()
        for rank, why in self.liveness.deaths(now, self.mail.take_unreachable(),
                                              self.controller):
            self._declare_dead(rank, why)
        self.link.check(now)
        self._check_step(now)  # a dead rank's answer will not come; a failure may be explained
        self.liveness.watch(now, self.controller, self.link.window_s, self.log.event)


    def _declare_dead(self, rank: int, why: str) -> None:
        if rank in self.controller.state.dead:
            return
        roles = self.controller.state.roles
        self.log.event("rank_dead", rank=rank, role=roles[rank].value, why=why)
        self.link.forget(rank)
        end_sessions(self.env_url, rank, self.log.event)
        self._apply(self.controller.rank_dead(rank, why, self.clock()))

    # ---------------------------------------------------------------- commands out

    def _apply(self, commands: list[c.Command]) -> None:
        """Each command to its part; a checkpoint's event after the whole batch (what the batch
        does is in the checkpoint's state: its events go before the mark a resume cuts at)."""
        checkpoint = None
        for command in commands:
            if isinstance(command, c.StartStep | c.Dispatch | c.CloseStep | c.AbortStep):
                self.steps.send(command, self.store.samples, self.store.rewards,
                                self.controller.state.dead)
            elif isinstance(command, c.FeedGroups):
                self._feed(command)
            elif isinstance(command, c.JoinRollout):
                self.router.on_joined(command.rank)
            elif isinstance(command, c.LeaveRollout):
                self.router.on_left(command.rank, command.task_ids, command.is_dead,
                                    self.controller.rollout.is_known)
            elif isinstance(command, c.RecordStep):
                self.mail.server.publish(self.log.record(command.record, self.controller,
                                                         self.desk.note))
            elif isinstance(command, c.Boundary):
                checkpoint = self._boundary(command) or checkpoint
            elif isinstance(command, c.GroupDropped):
                self.store.drop(command, self.log.event)
            elif isinstance(command, c.PlanRefused):
                self.log.event("plan_refused", reason=command.reason,
                               reason_plan=command.plan_reason.value)
            elif isinstance(command, c.ManualReply):
                self.desk.deliver(command)
            elif isinstance(command, c.Finish):
                self.is_finished = True
            elif isinstance(command, c.Abort):
                raise CoordinatorError(command.reason)
        if checkpoint is not None:
            self.log.event("checkpoint", version=checkpoint[0], folder=str(checkpoint[1]))

    def _feed(self, command: c.FeedGroups) -> None:
        for spec in command.groups:
            self.store.feed(spec)
        if command.is_eval:
            self.log.event("eval_start", step=command.groups[0].step,
                           version=self.controller.state.version, groups=len(command.groups))

    def _boundary(self, boundary: c.Boundary) -> tuple[int, Path] | None:
        """The boundary sent (its role changes announced); the version and folder of the
        checkpoint it starts, if it starts one."""
        root, folder = self.log.run_dir / checkpoints.CHECKPOINTS, None
        if boundary.checkpoint:
            point = resume_point(self.controller, self.clock())
            state = checkpoints.CheckpointState(point, self.store.ready_state(point.ready))
            folder = checkpoints.start_checkpoint(root, boundary.version, self.profile, state)
        self.link.send(boundary, self.controller.state.step, str(root),
                       str(self.log.run_dir / "hf"))
        return None if folder is None else (boundary.version, folder)
