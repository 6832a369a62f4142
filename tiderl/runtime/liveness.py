"""Whether the job's ranks are alive and whether the job makes progress: the coordinator's
watch over its ranks.

    Hello / any message from a rank ──> alive, its heartbeat
    a send that finds a rank's connection gone ──> unreachable (declared dead at the next
        check, not amid the commands being applied: its death may send a boundary again,
        which must not cut into the one going out)
    silent past runtime.heartbeat_s x heartbeat_misses ──> dead
    no turn, task, step or acknowledgement for a watchdog window ──> a watchdog event; three
        windows: the job stops (resumable), never a silent hang
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tiderl.core.step_control import StepController
from tiderl.env.client import EnvClientError, end_sessions_of
from tiderl.profile import Profile
from tiderl.runtime import bus as b
from tiderl.runtime.bus import BusSendError, BusServer, HeartbeatMonitor, rank_identity
from tiderl.runtime.errors import CoordinatorError

log = logging.getLogger("tiderl.coordinator")

STALL_STOP_FACTOR = 3  # the job stops after this many watchdog windows without progress
WORK = (b.TurnReport, b.TaskFinished, b.StepDone, b.StepFailed, b.Ack)  # what counts as progress


class RankMail:
    """Messages to the ranks through the coordinator's ROUTER, each command with its own
    sequence number; a rank whose connection is gone is noted, not waited for."""

    def __init__(self, server: BusServer) -> None:
        self.server = server
        self.seq = 0
        self.unreachable: set[int] = set()

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def send(self, rank: int, msg: b.Message, dead: set[int]) -> None:
        if rank in dead or rank in self.unreachable:
            return
        try:
            self.server.send(rank_identity(rank), msg)
        except BusSendError as exc:  # its connection is gone: no need to wait for heartbeats
            log.warning("%s", exc)
            self.unreachable.add(rank)

    def take_unreachable(self) -> set[int]:
        unreachable, self.unreachable = self.unreachable, set()
        return unreachable


class Liveness:
    """The ranks that said Hello, their heartbeats, and the last report of work done."""

    def __init__(self, profile: Profile, now: float) -> None:
        rt = profile.runtime
        self.runtime = rt
        self.heartbeats = HeartbeatMonitor(rt.heartbeat_s, rt.heartbeat_misses)
        self.window_s = rt.heartbeat_s * (rt.heartbeat_misses + 1)  # to name a dead rank
        self.alive: set[int] = set()
        self.progress_at = now  # the last report of work done
        self.stalled_s = 0.0  # the watchdog's last alarm (0: none since the last progress)

    def heard(self, rank: int, msg: b.Message, now: float) -> None:
        self.heartbeats.beat(rank, now)
        if isinstance(msg, b.Hello):
            self.alive.add(rank)
        if isinstance(msg, WORK):
            self.progress_at, self.stalled_s = now, 0.0

    def deaths(self, now: float, unreachable: set[int],
               ctl: StepController) -> list[tuple[int, str]]:
        """The ranks to declare dead now, with why: those a send found unreachable, then those
        silent past the heartbeat window. CoordinatorError when none would be left."""
        silent = [r for r in self.heartbeats.dead(now) if r not in unreachable]
        gone = ctl.state.dead | unreachable | set(silent)
        if (unreachable or silent) and len(gone) == len(ctl.state.roles):
            raise CoordinatorError(f"every rank is gone (ranks {sorted(unreachable | set(silent))}"
                                   " missed their heartbeats or lost their bus connection)")
        return [*((r, "its bus connection is gone") for r in sorted(unreachable)),
                *((r, "missed heartbeats") for r in silent)]

    def watchdog_s(self, ctl: StepController, broadcast_window_s: float) -> float:
        """How long the job may go without a report of work done before the watchdog speaks:
        ``runtime.watchdog_factor`` mean step times, at least ``runtime.watchdog_s``, and more
        than a trainer collective may block when a member stopped in it (it fails after
        ``collective_timeout_s``, and the step runs again without it: progress to come)."""
        rt, records = self.runtime, ctl.ledger.records
        mean_step_s = records[-1].end_s / len(records) if records else 0.0
        return max(rt.watchdog_s, rt.watchdog_factor * mean_step_s,
                   rt.collective_timeout_s + broadcast_window_s)

    def watch(self, now: float, ctl: StepController, broadcast_window_s: float,
              event: Callable[..., None]) -> None:
        """No report of work done for a watchdog window: an event naming what the step cycle
        waits for (once per window); after STALL_STOP_FACTOR windows, CoordinatorError."""
        window = self.watchdog_s(ctl, broadcast_window_s)
        idle = now - self.progress_at
        if idle < window or idle - self.stalled_s < window:
            return
        self.stalled_s = idle
        what = waits(ctl)
        event("watchdog", idle_s=round(idle, 1), window_s=round(window, 1), **what)
        log.error("no progress for %.0f s (%s)", idle, what)
        if idle >= STALL_STOP_FACTOR * window:
            raise CoordinatorError(f"no progress for {idle:.0f} s (the step cycle is in phase "
                                   f"{ctl.state.phase.value} at step {ctl.state.step})")


def waits(ctl: StepController) -> dict[str, object]:
    """What the step cycle waits for, as a watchdog event says it."""
    pending, book = ctl.boundaries.pending, ctl.rollout.book
    return {"phase": ctl.state.phase.value, "step": ctl.state.step, "tasks_new": book.num_new,
            "tasks_active": book.num_active, "tasks_paused": book.num_paused,
            "rollout_ranks": ctl.rollout_ranks(),
            "awaiting": sorted(pending.awaiting) if pending else []}


def end_sessions(env_url: str, rank: int, event: Callable[..., None]) -> None:
    """The environment sessions of a dead rank's tasks end now (their tasks start again
    elsewhere), instead of holding the service's table until they expire. One bounded call;
    a service that does not answer leaves them to expire."""
    if not env_url:
        return
    try:
        ended = end_sessions_of(env_url, rank_identity(rank).decode())
    except EnvClientError as exc:
        event("env_sessions_ended", rank=rank, ended=None, error=str(exc)[:200])
        return
    event("env_sessions_ended", rank=rank, ended=ended)
