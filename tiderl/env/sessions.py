"""The session table of the environment service: pure state, time from an injected clock.

    create ──> active ──pause──> paused ──resume──> active ──end──> (gone)
                 │  idle longer than the TTL (checked at ``now``)      │
                 └──────────────────────> expired (gone) <─────────────┘ never while paused
    create on a full table ──> the longest-idle session not in a step is evicted (gone)

A full table never locks new sessions out: ``create`` evicts the session idle longest (active
ones before paused ones; never one with a step in flight, see ``begin_step``) and refuses
(:class:`SessionLimit`) only when every session is in a step, which ends within a step's time.

Invariant: ``len(sessions) <= max_sessions``, and no session is returned once it has been idle
(not paused, not in a step) for longer than ``idle_ttl_s``. Every method takes ``now``; nothing
reads a clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from tiderl.core.quote import short

T = TypeVar("T")


class SessionState(str, Enum):
    ACTIVE = "active"
    PAUSED = "paused"


BUSY_RETRY_AFTER_S = 1.0  # a full table of sessions in a step: one ends within a step's time


class SessionLimit(Exception):
    """The table is full of sessions in a step (answered 429 with ``Retry-After``)."""

    def __init__(self, max_sessions: int, retry_after_s: float = BUSY_RETRY_AFTER_S):
        super().__init__(f"session limit reached ({max_sessions} open, every one in a step); "
                         "retry later")
        self.retry_after_s = retry_after_s


class UnknownSession(KeyError):
    """No such session: never created, ended or expired (answered 404)."""

    def __init__(self, session: str, reason: str = "unknown"):
        super().__init__(session)
        self.session = session
        self.reason = reason

    def __str__(self) -> str:
        return f"session {short(self.session)}: {self.reason}"


@dataclass
class Session(Generic[T]):
    id: str
    env_name: str
    env: T
    last_active: float
    state: SessionState = SessionState.ACTIVE
    num_steps: int = 0
    is_done: bool = False  # the episode ended; only /end is left
    num_in_step: int = 0  # steps in flight (begin_step .. end_step): never evicted meanwhile
    owner: str = ""  # who started it (a job's rank), for end_owner


@dataclass
class SessionCounters:
    num_created: int = 0
    num_ended: int = 0
    num_expired: int = 0
    num_rejected: int = 0
    num_evicted: int = 0


@dataclass
class SessionTable(Generic[T]):
    max_sessions: int
    idle_ttl_s: float
    sessions: dict[str, Session[T]] = field(default_factory=dict)
    counters: SessionCounters = field(default_factory=SessionCounters)
    on_drop: Callable[[T], None] | None = None  # told of every session that goes, however
    _next_id: int = 0

    def create(self, env_name: str, env: T, now: float, owner: str = "") -> Session[T]:
        """A new session; on a full table the longest-idle one is evicted first
        (:class:`SessionLimit` when every session is in a step)."""
        self.check_room(now)
        if len(self.sessions) >= self.max_sessions:
            victim = self._eviction_candidate()
            assert victim is not None  # check_room found one
            del self.sessions[victim.id]
            self.counters.num_evicted += 1
            self._dropped(victim)
        self._next_id += 1
        session = Session(f"s{self._next_id}", env_name, env, now, owner=owner)
        self.sessions[session.id] = session
        self.counters.num_created += 1
        return session

    def check_room(self, now: float) -> None:
        """On a full table, expire idle sessions; :class:`SessionLimit` if it is still full and
        every session is in a step (nothing to evict). A table with room leaves its expired
        sessions to ``get`` and ``expire`` (the server sweeps every few seconds): scanning every
        session at every start cost a fifth of the server's time at 256 sessions."""
        if len(self.sessions) < self.max_sessions:
            return
        self.expire(now)
        if len(self.sessions) >= self.max_sessions and self._eviction_candidate() is None:
            self.counters.num_rejected += 1
            raise SessionLimit(self.max_sessions)

    def begin_step(self, session_id: str, now: float) -> Session[T]:
        """The session is in a step until ``end_step``: touched, and never evicted."""
        session = self.touch(session_id, now)
        session.num_in_step += 1
        return session

    def end_step(self, session: Session[T], now: float) -> None:
        session.num_in_step -= 1
        session.last_active = now

    def get(self, session_id: str, now: float) -> Session[T]:
        """The session, or :class:`UnknownSession`; an expired one is dropped here."""
        session = self.sessions.get(session_id)
        if session is None:
            raise UnknownSession(session_id)
        if self.is_expired(session, now):
            self._drop(session_id, expired=True)
            raise UnknownSession(session_id, "expired")
        return session

    def touch(self, session_id: str, now: float) -> Session[T]:
        session = self.get(session_id, now)
        session.last_active = now
        return session

    def pause(self, session_id: str, now: float) -> Session[T]:
        """Stop the idle clock (pausing a paused session is a no-op)."""
        session = self.get(session_id, now)
        session.state = SessionState.PAUSED
        session.last_active = now
        return session

    def resume(self, session_id: str, now: float) -> Session[T]:
        """Restart the idle clock from ``now`` (resuming an active session only touches it)."""
        session = self.get(session_id, now)
        session.state = SessionState.ACTIVE
        session.last_active = now
        return session

    def end(self, session_id: str, now: float) -> Session[T]:
        session = self.get(session_id, now)
        self._drop(session_id, expired=False)
        return session

    def end_owner(self, owner: str) -> int:
        """End every session ``owner`` started (its holder died); how many there were."""
        ids = [s.id for s in self.sessions.values() if s.owner == owner]
        for session_id in ids:
            self._drop(session_id, expired=False)
        return len(ids)

    def expire(self, now: float) -> list[str]:
        """Drop every idle session past the TTL (paused ones never); return their ids."""
        gone = [s.id for s in self.sessions.values() if self.is_expired(s, now)]
        for session_id in gone:
            self._drop(session_id, expired=True)
        return gone

    def is_expired(self, session: Session[T], now: float) -> bool:
        """Idle past the TTL: active, and not in a step (an agent's step lasts as long as its
        agent thinks and runs its tools, which may pass the TTL)."""
        return (session.state is SessionState.ACTIVE and session.num_in_step == 0
                and now - session.last_active > self.idle_ttl_s)

    def _eviction_candidate(self) -> Session[T] | None:
        """The session idle longest and not in a step, active before paused; None if none."""
        idle = [s for s in self.sessions.values() if s.num_in_step == 0]
        return min(idle, key=lambda s: (s.state is SessionState.PAUSED, s.last_active),
                   default=None)

    @property
    def num_open(self) -> int:
        return len(self.sessions)

    @property
    def num_paused(self) -> int:
        return sum(s.state is SessionState.PAUSED for s in self.sessions.values())

    def _drop(self, session_id: str, *, expired: bool) -> None:
        session = self.sessions.pop(session_id)
        if expired:
            self.counters.num_expired += 1
        else:
            self.counters.num_ended += 1
        self._dropped(session)

    def _dropped(self, session: Session[T]) -> None:
        if self.on_drop is not None:
            self.on_drop(session.env)
