"""Bus identities (issue 18) over real CURVE sockets on loopback: each rank's key speaks only as
that rank, the operator's only sends operator messages, and nobody takes a live rank's identity."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from tests.waiting import wait_until
from tiderl.runtime.bus import (
    AdmitTask,
    BusClient,
    BusServer,
    Heartbeat,
    Hello,
    Message,
    Rebalance,
    ServerKeys,
    Shutdown,
    Subscriber,
    TurnReport,
    load_job_keys,
    make_job_keys,
    rank_identity,
)
from tiderl.runtime.bus.gatekeeper import refusal

QUIET_S = 0.5  # how long a message that should not arrive is given to arrive
ARRIVE_S = 60.0  # how long one that should arrive may take: longer is a hang, not a slow machine


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, ServerKeys]:
    return tmp_path / "keys", make_job_keys(tmp_path / "keys", 3)


@pytest.fixture
def server(job: tuple[Path, ServerKeys]) -> Iterator[BusServer]:
    with BusServer(job[1]) as srv:
        yield srv


def _client(server: BusServer, keys_dir: Path, peer: int | str, identity: bytes) -> BusClient:
    """A connected DEALER with ``peer``'s key and ``identity`` (its handshake done)."""
    client = BusClient(server.endpoint, load_job_keys(keys_dir, peer), identity)
    wait_until(lambda: client.down_for() == 0, f"the handshake of {peer} as {identity!r}",
               timeout_s=ARRIVE_S, interval_s=0.01)
    return client


def _received(server: BusServer, num: int, num_dropped: int = 0,
              quiet_s: float = QUIET_S) -> list[tuple[bytes, Message]]:
    """What the server admits: read until ``num`` messages are admitted and ``num_dropped``
    dropped (sent on several connections, they come in any order), then on until ``quiet_s``
    passes with nothing more (there should be nothing more)."""
    got: list[tuple[bytes, Message]] = []
    deadline = time.monotonic() + ARRIVE_S
    while len(got) < num or server.drops.total < num_dropped:
        assert time.monotonic() < deadline, (
            f"in {ARRIVE_S:.0f} s: {len(got)} of {num} messages admitted ({got}), "
            f"{server.drops.total} of {num_dropped} dropped")
        if (item := server.recv(timeout_s=0.05)) is not None:
            got.append(item)
    while (item := server.recv(timeout_s=quiet_s)) is not None:
        got.append(item)
    return got


def _dropped(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "bus: dropped" in r.getMessage()]


def _beat(rank: int, at: float = 0.0) -> Heartbeat:
    return Heartbeat(rank=rank, sent_at=at)


def test_a_rank_key_speaking_as_another_rank_is_dropped_and_logged(
        server: BusServer, job: tuple[Path, ServerKeys],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tiderl.runtime.bus")
    with _client(server, job[0], 1, rank_identity(2)) as as_two, \
            _client(server, job[0], 1, rank_identity(1)) as one:
        as_two.send(_beat(2))  # rank 1's key under rank 2's identity
        one.send(_beat(0))  # its own identity, another rank in the message
        for at in (1.0, 2.0):  # held back: one line a minute per key and reason
            one.send(_beat(0, at))
        one.send(_beat(1, 9.0))
        assert _received(server, 1, num_dropped=4) == [(rank_identity(1), _beat(1, 9.0))]
    assert (server.drops.forged, server.drops.total) == (4, 4)
    assert sorted(_dropped(caplog)) == [
        "bus: dropped a Heartbeat from b'rank-1': its rank field is not rank-1's",
        "bus: dropped a Heartbeat from b'rank-2': it came with rank-1's key"]


def test_an_impostor_with_rank_0s_identity_does_not_disturb_rank_0(
        server: BusServer, job: tuple[Path, ServerKeys]) -> None:
    """The takeover of issue 18: rank 1's key and identity ``rank-0`` while rank 0 is up. The
    ROUTER keeps rank 0's connection (no handover) and reads nothing from the impostor; once
    rank 0's connection is closed, rank 0 reconnects with its key and identity and is served."""
    real = _client(server, job[0], 0, rank_identity(0))
    real.send(Hello(rank=0, pid=1, host="h", role="rollout", device="cpu"))
    assert _received(server, 1)[0][1] == Hello(rank=0, pid=1, host="h", role="rollout",
                                               device="cpu")
    with _client(server, job[0], 1, rank_identity(0)) as impostor:
        impostor.send(_beat(0, 1.0))
        impostor.send(_beat(1, 1.0))
        real.send(_beat(0, 2.0))
        assert _received(server, 1) == [(rank_identity(0), _beat(0, 2.0))]
        server.send(rank_identity(0), Shutdown(seq=7, reason="to the real one"))
        assert real.recv(timeout_s=ARRIVE_S) == Shutdown(seq=7, reason="to the real one")
        assert impostor.recv(timeout_s=QUIET_S) is None
        real.close()  # rank 0 restarts, the impostor still connected; the server, receiving
        assert _received(server, 0, quiet_s=0.3) == []  # as the coordinator's loop does, sees
        with _client(server, job[0], 0, rank_identity(0)) as again:  # the old connection end
            again.send(_beat(0, 3.0))
            impostor.send(_beat(0, 4.0))
            assert _received(server, 1) == [(rank_identity(0), _beat(0, 3.0))]
            server.send(rank_identity(0), Shutdown(seq=8, reason="back"))
            assert again.recv(timeout_s=ARRIVE_S) == Shutdown(seq=8, reason="back")
            assert impostor.recv(timeout_s=QUIET_S) is None
    assert server.drops.total == 0  # ZeroMQ never read the impostor's connection


def test_the_operator_key_sends_operator_messages_only(
        server: BusServer, job: tuple[Path, ServerKeys]) -> None:
    rebalance = Rebalance(seq=1, rollout=2, trainer=1)
    with _client(server, job[0], "operator", b"ctl-1") as ctl, \
            _client(server, job[0], "operator", rank_identity(2)) as as_rank:
        ctl.send(Hello(rank=0, pid=1, host="h", role="rollout", device="cpu"))
        ctl.send(_beat(0))
        as_rank.send(rebalance)  # under a rank's identity: not even a Rebalance
        ctl.send(rebalance)
        assert _received(server, 1, num_dropped=3) == [(b"ctl-1", rebalance)]
    assert (server.drops.forbidden, server.drops.forged) == (2, 1)


def test_a_rank_key_cannot_send_rebalance_or_a_coordinators_command(
        server: BusServer, job: tuple[Path, ServerKeys],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tiderl.runtime.bus")
    with _client(server, job[0], 0, rank_identity(0)) as rank:
        rank.send(Rebalance(seq=1, rollout=2, trainer=1))
        rank.send(AdmitTask(seq=2, task_id="t", group_id="g", env="guess", seed=0))
        rank.send(TurnReport(rank=0, task_id="t", tokens=1, context_tokens=1, done=False,
                             version=0))
        assert [m for _, m in _received(server, 1, num_dropped=2)] == [
            TurnReport(rank=0, task_id="t", tokens=1, context_tokens=1, done=False, version=0)]
    assert server.drops.forbidden == 2
    assert _dropped(caplog) == [
        "bus: dropped a Rebalance from b'rank-0': a rank's key sends rank messages only"]


def test_the_pub_serves_the_operator_key_only(server: BusServer, job: tuple[Path, ServerKeys],
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tiderl.runtime.bus")
    with Subscriber(server.pub_endpoint, load_job_keys(job[0], "operator")) as top, \
            Subscriber(server.pub_endpoint, load_job_keys(job[0], 1)) as rank:
        beat = Rebalance(seq=0)  # any message: the PUB sends what it is given
        deadline = time.monotonic() + ARRIVE_S
        while (got := top.recv(timeout_s=0.05)) is None:  # a PUB drops until the SUB is in
            assert time.monotonic() < deadline, f"the operator's SUB got nothing in {ARRIVE_S} s"
            server.publish(beat)
        assert got == beat
        wait_until(lambda: any("(rank-1's key on the PUB, which serves the operator)"
                               in r.getMessage() for r in caplog.records),
                   "rank 1's SUB refused", timeout_s=ARRIVE_S)
        server.publish(beat)
        assert rank.recv(timeout_s=QUIET_S) is None


def test_a_plain_peer_cannot_send_anything(server: BusServer) -> None:
    ctx = zmq.Context()
    plain = ctx.socket(zmq.DEALER)
    plain.linger = 0
    plain.identity = rank_identity(0)
    plain.connect(server.endpoint)
    try:
        plain.send_multipart([b"\x02", b"\x01", b"\x82\xa4rank\x00\xa7sent_at\xcb" + bytes(8)])
        assert server.recv(timeout_s=QUIET_S) is None
        assert server.gatekeeper is not None  # its handshake failed (while it tries, at least once)
        wait_until(lambda: server.gatekeeper.num_failed_handshakes >= 1, "a failed handshake",
                   timeout_s=ARRIVE_S)
    finally:
        plain.close()
        ctx.term()


@pytest.mark.parametrize(("owner", "identity", "msg", "why"), [
    ("rank-2", b"rank-2", _beat(2), None),
    ("rank-2", b"rank-3", _beat(3), ("forged", "it came with rank-2's key")),
    ("rank-2", b"rank-2", _beat(3), ("forged", "its rank field is not rank-2's")),
    ("rank-2", b"rank-2", Rebalance(seq=0), ("forbidden", "a rank's key sends rank messages only")),
    ("rank-2", b"rank-2", Shutdown(seq=0, reason=""),
     ("forbidden", "a rank's key sends rank messages only")),
    ("operator", b"ctl-9", Rebalance(seq=0), None),
    ("operator", b"ctl-9", _beat(0), ("forbidden", "the operator key sends Rebalance only")),
    ("operator", b"rank-0", Rebalance(seq=0),
     ("forged", "the operator key under a rank's identity")),
    ("client", b"rank-0", _beat(0), ("forged", "no key of this job is named 'client'")),
])
def test_the_rule_of_who_may_send_what(owner: str, identity: bytes, msg: Message,
                                       why: tuple[str, str] | None) -> None:
    assert refusal(owner, identity, msg) == why
