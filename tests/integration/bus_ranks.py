"""The rank daemons' side of a coordinator's bus, for tests that drive a real Coordinator in
process: one real DEALER socket per rank, a clock the test sets, and the messages a rank sends."""

from __future__ import annotations

import time

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
            self.send(rank, Hello(rank=rank, pid=1, host="h", role="?", device="cpu"))

    def send(self, rank: int, msg: Message) -> None:
        self.clients[rank].send(msg)
        got = self.server.recv(5.0)
        assert got is not None, f"the coordinator did not get {type(msg).__name__}"
        self.coordinator.handle(*got)

    def drain(self, rank: int, quiet_s: float = 0.1) -> list[Message]:
        """What rank ``rank`` received since the last drain, once ``quiet_s`` passed with none
        arriving (messages still in flight on loopback come in)."""
        while self._take(rank, quiet_s):
            pass
        got, self.inbox[rank] = self.inbox[rank], []
        return got

    def _take(self, rank: int, wait_s: float) -> bool:
        """One message into rank ``rank``'s inbox (SyncWeights noted for acks); False if none."""
        msg = self.clients[rank].recv(wait_s)
        if msg is None:
            return False
        self.inbox[rank].append(msg)
        if isinstance(msg, SyncWeights):
            self.sync_seqs[(rank, msg.version)] = msg.seq
        return True

    def ack(self, rank: int, version: int, ok: bool = True, error: str = "") -> None:
        deadline = time.monotonic() + 5.0
        while (rank, version) not in self.sync_seqs:
            assert time.monotonic() < deadline, f"no SyncWeights v{version} for rank {rank}"
            self._take(rank, 0.1)
        self.send(rank, Ack(rank=rank, ref=self.sync_seqs.pop((rank, version)), ok=ok,
                            error=error))

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
