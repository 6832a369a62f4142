"""A boundary on the bus: one ``SyncWeights`` per member, and its answers mapped back.

    Boundary (from the step controller) ──SyncWeights, a seq each──> every live member
    Ack ok ──(rank, version)──> StepController.boundary_acked
    Ack failed (a member died in the broadcast): wait for the heartbeats to say who ──>
        a member is dead: the same roles and version again, to the live members, once (a
        trainer rank's death: the controller sends the boundary again itself, with new roles)
        every member alive past the heartbeat window: the job fails (a real error)
    Ack failed for another command (a training step): the job fails, but only after the
    heartbeat window, so that a rank that died in the step's collective is the one named
    (its peers' "connection closed" errors are its consequence, not the cause)

The broadcast is a collective: a member that dies in it fails it for all. The step controller
only counts acknowledgements; which answer belongs to which attempt is this link's business.
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
class FailedBroadcast:
    sync: b.SyncWeights
    deadline: float
    error: str


class BoundaryLink:
    def __init__(self, send: Callable[[int, b.Message], None], next_seq: Callable[[], int],
                 window_s: float) -> None:
        self._send, self._next_seq = send, next_seq
        self.window_s = window_s  # how long heartbeats take to name a dead member
        self.sent: dict[int, tuple[int, b.SyncWeights]] = {}  # seq -> (rank, message)
        self.superseded: set[int] = set()  # seqs of an attempt sent again without a dead member
        self.failed: dict[int, FailedBroadcast] = {}  # version -> the failed attempt
        self.resent: set[int] = set()  # versions sent again already
        self.step_failures: list[tuple[float, b.Ack]] = []  # (deadline, answer)
        self.announced: tuple[Role, ...] = ()  # the roles of the last boundary announced

    def announce(self, boundary: Boundary) -> list[tuple[int, Role, Role]]:
        """The role changes ``boundary`` makes against the layout last announced (so a boundary
        sent again announces nothing twice); a rank that died or comes back idle is not one."""
        before, self.announced = self.announced or boundary.old_roles, boundary.roles
        return [(rank, src, dst)
                for rank, (src, dst) in enumerate(zip(before, boundary.roles, strict=True))
                if src is not dst and Role.IDLE not in (src, dst)]

    def send(self, boundary: Boundary, checkpoint_dir: str, export_dir: str) -> None:
        """A boundary of a version already out replaces it (the step controller sent it again
        without a dead trainer rank): the attempts before are superseded, not resent."""
        self._supersede(boundary.version)
        self.failed.pop(boundary.version, None)
        self.resent.discard(boundary.version)
        self._send_all(b.SyncWeights(
            seq=0, version=boundary.version, src_rank=boundary.src_rank,
            roles=[role.value for role in boundary.roles], members=list(boundary.members),
            joiners=list(boundary.joiners),
            checkpoint=checkpoint_dir if boundary.checkpoint else "",
            export=export_dir if boundary.export else ""))

    def _send_all(self, sync: b.SyncWeights) -> None:
        for rank in sync.members:
            seq = self._next_seq()
            msg = replace_struct(sync, seq=seq)
            self.sent[seq] = (rank, msg)
            self._send(rank, msg)

    def on_ack(self, msg: b.Ack, now: float) -> tuple[int, int] | None:
        """(rank, version) for a boundary taken; None for any other answer. A failed answer to
        a command that is not a boundary is the job's failure."""
        if msg.ref in self.superseded:
            return None  # an answer to an attempt that was sent again without a dead member
        entry = self.sent.pop(msg.ref, None)
        if msg.ok:
            return (entry[0], entry[1].version) if entry is not None else None
        if entry is None:
            self.step_failures.append((now + self.window_s, msg))
            return None
        sync = entry[1]
        self.superseded.add(msg.ref)
        self.failed.setdefault(sync.version, FailedBroadcast(sync, now + self.window_s,
                                                             msg.error))
        return None

    def forget(self, rank: int) -> None:
        """``rank`` died: its answers will not come."""
        for seq in [s for s, (r, _) in self.sent.items() if r == rank]:
            del self.sent[seq]

    def check(self, dead: set[int], now: float) -> list[int]:
        """Resend failed broadcasts a member of which died; the versions resent."""
        for deadline, msg in self.step_failures:
            if now > deadline:
                raise CoordinatorError(f"rank {msg.rank} failed: {msg.error}")
        resent = []
        for version, failed in list(self.failed.items()):
            if set(failed.sync.members) & dead:
                del self.failed[version]
                if self._resend(failed.sync, dead):
                    resent.append(version)
            elif now > failed.deadline:
                raise CoordinatorError(f"the weight broadcast of version {version} failed with "
                                       f"every rank alive: {failed.error}")
        return resent

    def _resend(self, failed: b.SyncWeights, dead: set[int]) -> bool:
        """Once per failed boundary: the same roles and version, the live members only (the
        actors saved their checkpoint before the broadcast: not again)."""
        members = [r for r in failed.members if r not in dead]
        if failed.version in self.resent or not members:
            return False
        self.resent.add(failed.version)
        self._supersede(failed.version)
        self._send_all(replace_struct(failed, members=members, seq=0, checkpoint=""))
        return True

    def _supersede(self, version: int) -> None:
        """The answers still awaited for ``version`` belong to an attempt sent again."""
        for seq in [s for s, (_, m) in self.sent.items() if m.version == version]:
            del self.sent[seq]
            self.superseded.add(seq)
