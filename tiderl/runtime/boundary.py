"""A boundary on the bus: one ``SyncWeights`` per member, and its answers mapped back.

    Boundary (from the step controller) ──SyncWeights, a seq each, the source's feed address──>
        every live member (the source publishes the weights; each rank that needs them fetches
        them from its feed on a connection of its own)
    Ack ok ──(rank, version)──> StepController.boundary_acked
    Ack failed: wait the heartbeat window for a death that explains it: the rank's own (its
        engine server died with it), or the source's (its receivers' fetches break off: the
        step controller sends the boundary again from another actor, which supersedes the
        attempt); with no such death the job fails, naming the rank and its error
    Ack failed for another command (a training step): the job fails, but only after the
    heartbeat window, so that a rank that died in the step's collective is the one named
    (its peers' "connection closed" errors are its consequence, not the cause)

No member waits for another: a member that dies in a boundary is left out of it when the
heartbeats name it (the step controller forgets it), and costs no one else anything. The step
controller only counts acknowledgements; which answer belongs to which attempt is this link's
business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from msgspec.structs import replace as replace_struct

from tiderl.core.commands import Boundary
from tiderl.core.types import Role
from tiderl.runtime import bus as b
from tiderl.runtime.errors import CoordinatorError


@dataclass(frozen=True)
class FailedBoundary:
    rank: int
    version: int
    deadline: float
    error: str


class BoundaryLink:
    def __init__(self, send: Callable[[int, b.Message], None], next_seq: Callable[[], int],
                 window_s: float, event: Callable[..., None] = lambda kind, **fields: None
                 ) -> None:
        """``event``: the run log's, for each role change a boundary makes."""
        self._send, self._next_seq, self._event = send, next_seq, event
        self.window_s = window_s  # how long heartbeats take to name a dead member
        self.feeds: dict[int, str] = {}  # rank -> host:port of its weight feed (its Hello)
        self.sent: dict[int, tuple[int, b.SyncWeights]] = {}  # seq -> (rank, message)
        self.superseded: set[int] = set()  # seqs of an attempt sent again
        self.failed: dict[tuple[int, int], FailedBoundary] = {}  # (version, rank) -> failure
        self.step_failures: list[tuple[float, b.Ack]] = []  # (deadline, answer)
        self.announced: tuple[Role, ...] = ()  # the roles of the last boundary announced

    def announce(self, boundary: Boundary) -> list[tuple[int, Role, Role]]:
        """The role changes ``boundary`` makes against the layout last announced (so a boundary
        sent again announces nothing twice); a rank that died or comes back idle is not one."""
        before, self.announced = self.announced or boundary.old_roles, boundary.roles
        return [(rank, src, dst)
                for rank, (src, dst) in enumerate(zip(before, boundary.roles, strict=True))
                if src is not dst and Role.IDLE not in (src, dst)]

    def send(self, boundary: Boundary, step: int, checkpoint_dir: str, export_dir: str) -> None:
        """Its role changes announced (a ``role_change`` event each), ``SyncWeights`` to every
        member. A boundary of a version already out replaces it (the step controller sent it
        again without a dead trainer rank): the attempts before are superseded."""
        for rank, src, dst in self.announce(boundary):  # a death is its rank_dead event
            self._event("role_change", rank=rank, src=src.value, dst=dst.value, step=step,
                        version=boundary.version,
                        reason=boundary.reason.value if boundary.reason else None)
        self._supersede(boundary.version)
        self.failed = {key: f for key, f in self.failed.items() if key[0] != boundary.version}
        sync = b.SyncWeights(
            seq=0, version=boundary.version, src_rank=boundary.src_rank,
            roles=[role.value for role in boundary.roles], members=list(boundary.members),
            joiners=list(boundary.joiners),
            checkpoint=checkpoint_dir if boundary.checkpoint else "",
            export=export_dir if boundary.export else "",
            source=self.feeds.get(boundary.src_rank, ""))
        for rank in sync.members:
            seq = self._next_seq()
            msg = replace_struct(sync, seq=seq)
            self.sent[seq] = (rank, msg)
            self._send(rank, msg)

    def on_ack(self, msg: b.Ack, now: float) -> tuple[int, int] | None:
        """(rank, version) for a boundary taken; None for any other answer. A failed answer to
        a command that is not a boundary is the job's failure."""
        if msg.ref in self.superseded:
            return None  # an answer to an attempt that was sent again
        entry = self.sent.pop(msg.ref, None)
        if msg.ok:
            return (entry[0], entry[1].version) if entry is not None else None
        if entry is None:
            self.step_failures.append((now + self.window_s, msg))
            return None
        rank, sync = entry
        self.failed[(sync.version, rank)] = FailedBoundary(rank, sync.version,
                                                           now + self.window_s, msg.error)
        return None

    def forget(self, rank: int) -> None:
        """``rank`` died: its answers will not come, and its death explains its own failure
        (an engine server that died with it)."""
        for seq in [s for s, (r, _) in self.sent.items() if r == rank]:
            del self.sent[seq]
        self.failed = {key: f for key, f in self.failed.items() if key[1] != rank}

    def check(self, now: float) -> None:
        """A failure that no death explained within the heartbeat window fails the job."""
        for deadline, msg in self.step_failures:
            if now > deadline:
                raise CoordinatorError(f"rank {msg.rank} failed: {msg.error}")
        for failed in self.failed.values():
            if now > failed.deadline:
                raise CoordinatorError(
                    f"rank {failed.rank} could not take the boundary of version "
                    f"{failed.version}, and no rank's death explains it: {failed.error}")

    def _supersede(self, version: int) -> None:
        """The answers still awaited for ``version`` belong to an attempt sent again."""
        for seq in [s for s, (_, m) in self.sent.items() if m.version == version]:
            del self.sent[seq]
            self.superseded.add(seq)
