"""The rank daemons' side of a coordinator's bus, for tests that drive a real Coordinator in
process: one real DEALER socket per rank, a clock the test sets, and the messages a rank sends."""

from __future__ import annotations

from tiderl.runtime.bus import (
    Ack,
    BusClient,
    BusServer,
    Hello,
    Message,
    SyncWeights,
    rank_identity,
)
from tiderl.runtime.coordinator import Coordinator

ARRIVE_S = 60.0  # how long a message that was sent may take to arrive: longer is a hang
# sent by the test on the coordinator's socket after what the coordinator sent (no message of a
# job has rank -1): one connection keeps its order, so what comes before it is all there was
MARK = Ack(rank=-1, ref=-1, ok=True, error="the end of what was sent before")


def sent_so_far(server: BusServer, identity: bytes, client: BusClient) -> list[Message]:
    """Every message the server had sent to ``client`` (connected as ``identity``) and it had
    not read yet: read up to a mark sent after them."""
    server.send(identity, MARK)
    got: list[Message] = []
    while (msg := client.recv(ARRIVE_S)) != MARK:
        assert msg is not None, f"{identity!r}: not even the mark came in {ARRIVE_S:.0f} s"
        got.append(msg)
    return got


class Clock:
    """The coordinator's clock: reads what the test set."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Ranks:
    """Rank ``r``'s socket sends as rank ``r``; every message is handled at once."""

    def __init__(self, server: BusServer, coordinator: Coordinator, num_ranks: int) -> None:
        self.server, self.coordinator = server, coordinator
        self.clients = {r: BusClient(server.endpoint, None, rank_identity(r))
                        for r in range(num_ranks)}
        self.inbox: dict[int, list[Message]] = {r: [] for r in range(num_ranks)}
        self.sync_seqs: dict[tuple[int, int], int] = {}

    def hello(self) -> None:
        for rank in self.clients:
            self.send(rank, Hello(rank=rank, pid=1, host="h", role="?", device="cpu",
                                       feed=f"127.0.0.1:{rank}"))

    def send(self, rank: int, msg: Message) -> None:
        self.clients[rank].send(msg)
        got = self.server.recv(ARRIVE_S)
        assert got is not None, f"the coordinator did not get {type(msg).__name__}"
        self.coordinator.handle(*got)

    def drain(self, rank: int) -> list[Message]:
        """What rank ``rank`` was sent since the last drain: all of it, in flight or not."""
        self._take(rank)
        got, self.inbox[rank] = self.inbox[rank], []
        return got

    def _take(self, rank: int) -> None:
        """What rank ``rank`` was sent so far into its inbox (SyncWeights noted for acks)."""
        for msg in sent_so_far(self.server, rank_identity(rank), self.clients[rank]):
            self.inbox[rank].append(msg)
            if isinstance(msg, SyncWeights):
                self.sync_seqs[(rank, msg.version)] = msg.seq

    def ack(self, rank: int, version: int, ok: bool = True, error: str = "") -> None:
        if (rank, version) not in self.sync_seqs:
            self._take(rank)
        assert (rank, version) in self.sync_seqs, f"no SyncWeights v{version} for rank {rank}"
        self.send(rank, Ack(rank=rank, ref=self.sync_seqs.pop((rank, version)), ok=ok,
                            error=error))

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
