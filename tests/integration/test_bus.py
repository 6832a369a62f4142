"""The bus over real CURVE sockets on loopback, with the rank side in a separate process."""

from __future__ import annotations

import logging
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from tests.integration.serving import HUNG_START_S
from tests.waiting import wait_until
from tiderl.runtime.bus import (
    Ack,
    AdmitTask,
    BusClient,
    BusError,
    BusKeyError,
    BusSendError,
    BusServer,
    Heartbeat,
    HeartbeatMonitor,
    Hello,
    JobKeys,
    Message,
    RankMetrics,
    ServerKeys,
    Shutdown,
    Snapshot,
    TaskFinished,
    TurnData,
    TurnReport,
    encode,
    load_job_keys,
    make_job_keys,
    rank_identity,
    set_curve_client,
)

NUM_MESSAGES = 500
ARRIVE_S = 60.0  # how long a message may take that should arrive: longer is a hang

# The rank side, run as `python -c PEER <mode> <endpoint> <keys dir>`: a real second process.
# Its waits for the test's messages are as long as ARRIVE_S; the test kills it when done.
PEER = """
import os, sys, time
import msgspec
from tiderl.runtime.bus import *
mode, endpoint, keys_dir = sys.argv[1:4]
WAIT_S = 60.0
if mode == "subscribe":
    with Subscriber(endpoint, load_job_keys(keys_dir, "operator")) as sub:
        sys.stdout.buffer.write(msgspec.json.encode(sub.recv(timeout_s=WAIT_S)))
    sys.exit(0)
with BusClient(endpoint, load_job_keys(keys_dir, 3), rank_identity(3)) as bus:
    if mode == "heartbeat":
        while True:
            bus.send(Heartbeat(rank=3, sent_at=time.time()))
            time.sleep(0.02)
    bus.send(Hello(rank=3, pid=os.getpid(), host="localhost", role="rollout", device="cpu"))
    assert bus.recv(timeout_s=WAIT_S) == Ack(rank=0, ref=0, ok=True)
    for i in range(int(sys.argv[4])):
        bus.send(TurnReport(rank=3, task_id=f"t{i}", tokens=i, context_tokens=2 * i,
                            done=False, version=1))
    while True:
        cmd = bus.recv(timeout_s=WAIT_S)
        if isinstance(cmd, Shutdown):
            break
        bus.send(Ack(rank=3, ref=cmd.seq, ok=True, error=cmd.task_id))
    turn = TurnData(context_ids=[1, 2], output_ids=[3], logprobs=[-0.5], version=1)
    bus.send(TaskFinished(rank=3, task_id="t0", group_id="g0", reward=1.0, turns=[turn],
                          num_tokens=3))
"""


NUM_RANKS = 6


@pytest.fixture
def job(tmp_path: Path) -> tuple[Path, ServerKeys]:
    return tmp_path / "keys", make_job_keys(tmp_path / "keys", NUM_RANKS)


@pytest.fixture
def server(job: tuple[Path, ServerKeys]) -> Iterator[BusServer]:
    with BusServer(job[1]) as srv:
        yield srv


def _peer(mode: str, endpoint: str, keys_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER, mode, endpoint, str(keys_dir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen) -> bytes:
    try:
        out, err = proc.communicate(timeout=ARRIVE_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    return out


def _recv_from(server: BusServer, proc: subprocess.Popen) -> tuple[bytes, Message]:
    """The server's next message, sent by the peer process ``proc``: waited for while it runs
    (a loaded machine starts a Python process slowly), a failure at once if it has exited."""
    deadline = time.monotonic() + HUNG_START_S
    while (got := server.recv(timeout_s=0.1)) is None:
        if proc.poll() is not None and (got := server.recv(timeout_s=0)) is None:
            raise AssertionError(f"the peer exited ({proc.returncode}) without sending: "
                                 f"{proc.stderr.read().decode()}")
        assert time.monotonic() < deadline, f"the peer runs but sent nothing in {HUNG_START_S} s"
    return got


def _rejections(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "bus: rejected" in r.getMessage()]


def test_key_files_are_private_and_load_back(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    keys = make_job_keys(folder, 2)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert sorted(p.name for p in folder.iterdir()) == [
        "http.secret", "operator.public", "operator.secret", "rank-0.public", "rank-0.secret",
        "rank-1.public", "rank-1.secret", "server.public", "server.secret"]
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_job_keys(folder, "coordinator") == keys
    assert sorted(keys.peers) == ["operator", "rank-0", "rank-1"]
    assert len(set(keys.peers.values())) == 3  # a pair each
    rank1 = load_job_keys(folder, 1)
    assert (rank1.peer, rank1.public, rank1.server_public) == (
        "rank-1", keys.peers["rank-1"], keys.server_public)
    assert rank1.secret == (folder / "rank-1.secret").read_bytes().strip()
    assert load_job_keys(folder, "operator").public == keys.peers["operator"]
    assert "secret" not in repr(keys) + repr(rank1)
    with pytest.raises(BusKeyError, match="already exists"):
        make_job_keys(folder, 2)
    with pytest.raises(BusKeyError, match=r"no peer 'rank-1' \(a rank number >= 0"):
        load_job_keys(folder, "rank-1")
    with pytest.raises(BusKeyError, match=r"cannot read bus key .*rank-2\.public: No such"):
        load_job_keys(folder, 2)
    with pytest.raises(BusKeyError, match="a bus server needs the coordinator's keys"):
        BusServer(rank1)
    (folder / "server.secret").unlink()  # what a rank's host holds
    assert load_job_keys(folder, 0).peer == "rank-0"
    with pytest.raises(BusKeyError, match=r"cannot read bus key .*server\.secret"):
        load_job_keys(folder, "coordinator")
    with pytest.raises(BusKeyError, match=r"cannot read bus key .*missing/server\.public"):
        load_job_keys(tmp_path / "missing", 0)
    with pytest.raises(BusKeyError, match="num_ranks must be an int >= 1, got 0"):
        make_job_keys(tmp_path / "none", 0)


def test_hello_ack_and_many_messages_both_ways_with_a_rank_process(
        server: BusServer, job: tuple[Path, ServerKeys]) -> None:
    proc = _peer("rank", server.endpoint, job[0], str(NUM_MESSAGES))
    try:
        identity, hello = _recv_from(server, proc)
        assert identity == rank_identity(3)
        assert hello == Hello(rank=3, pid=proc.pid, host="localhost", role="rollout",
                              device="cpu")
        server.send(identity, Ack(rank=0, ref=0, ok=True))
        for seq in range(NUM_MESSAGES):  # commands go out while reports stream in
            server.send(identity, AdmitTask(seq=seq, task_id=f"t{seq}", group_id="g0", env="guess",
                                        seed=seq))
        reports, acks = [], []
        while len(reports) + len(acks) < 2 * NUM_MESSAGES:
            got = _recv_from(server, proc)
            assert got[0] == identity
            (reports if isinstance(got[1], TurnReport) else acks).append(got[1])
        assert [r.tokens for r in reports] == list(range(NUM_MESSAGES))  # in order, none lost
        assert reports[7] == TurnReport(rank=3, task_id="t7", tokens=7, context_tokens=14,
                                        done=False, version=1)
        assert [(a.ref, a.error) for a in acks] == [(i, f"t{i}") for i in range(NUM_MESSAGES)]
        server.send(identity, Shutdown(seq=NUM_MESSAGES, reason="test done"))
        _, finished = _recv_from(server, proc)
        assert finished == TaskFinished(
            rank=3, task_id="t0", group_id="g0", reward=1.0, num_tokens=3,
            turns=[TurnData(context_ids=[1, 2], output_ids=[3], logprobs=[-0.5], version=1)])
    finally:
        _finish(proc)


def test_snapshot_reaches_a_subscriber_process(server: BusServer,
                                               job: tuple[Path, ServerKeys]) -> None:
    metrics = RankMetrics(rank=1, role="rollout", kv_tokens_used=10, kv_tokens_capacity=100,
                          prefix_hit_rate=0.5, running=2, waiting=0)
    snapshot = Snapshot(step=4, time=1.5, roles={0: "actor", 1: "rollout"},
                        metrics={"goodput_tok_s": 99.5}, ranks=[metrics],
                        ctb_budgets={1: 90})
    proc = _peer("subscribe", server.pub_endpoint, job[0])
    while proc.poll() is None:  # a PUB drops until the SUB joins; it exits once it has one
        server.publish(snapshot)
        time.sleep(0.02)
    assert msgspec.json.decode(_finish(proc), type=Snapshot) == snapshot


def test_a_peer_with_other_keys_is_rejected_and_logged(
        server: BusServer, job: tuple[Path, ServerKeys],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tiderl.runtime.bus")
    public, secret = zmq.curve_keypair()
    intruder_keys = JobKeys(server_public=job[1].server_public,  # knows the server, not the job
                            peer="rank-1", public=public, secret=secret)
    with BusClient(server.endpoint, intruder_keys, rank_identity(1)) as intruder:
        intruder.send(Heartbeat(rank=1, sent_at=0.0))
        assert server.recv(timeout_s=1.0) is None
        wait_until(lambda: _rejections(caplog), "the intruder rejected", timeout_s=ARRIVE_S)
    assert _rejections(caplog) == [
        f"bus: rejected a peer from 127.0.0.1 (unknown CURVE key {public[:8].decode()}…)"]
    assert server.gatekeeper is not None and server.gatekeeper.num_refused_keys == 1
    with BusClient(server.endpoint, load_job_keys(job[0], 1),
                   rank_identity(1)) as member:  # still serving
        member.send(Heartbeat(rank=1, sent_at=0.0))
        assert server.recv(timeout_s=ARRIVE_S) == (rank_identity(1),
                                                   Heartbeat(rank=1, sent_at=0.0))


def test_a_plain_peer_is_rejected_and_logged(server: BusServer,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tiderl.runtime.bus")
    ctx = zmq.Context()
    plain = ctx.socket(zmq.DEALER)
    plain.linger = 0
    plain.connect(server.endpoint)
    plain.send_multipart(encode(Heartbeat(rank=9, sent_at=0.0)))
    try:
        assert server.recv(timeout_s=1.0) is None
        wait_until(lambda: _rejections(caplog), "the plain peer rejected", timeout_s=ARRIVE_S)
    finally:
        plain.close()
        ctx.term()
    # Which side spots the mismatch first is a race: here it is the mismatch itself or the
    # plain peer hanging up mid-handshake. It reconnects every ~0.1 s, yet each is logged once.
    rejections = _rejections(caplog)
    prefix = f"bus: rejected a peer on {server.endpoint} (handshake failed: "
    assert 1 <= len(rejections) <= 2 and len(set(rejections)) == len(rejections)
    assert all(line.startswith(prefix) for line in rejections), rejections
    assert any(line.endswith(("the peer does not use CURVE)", "a peer without CURVE?)"))
               for line in rejections), rejections


def test_malformed_messages_are_dropped_and_logged_and_serving_goes_on(
        server: BusServer, job: tuple[Path, ServerKeys],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tiderl.runtime.bus")
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)  # authenticated, but writes frames by hand
    raw.linger = 0
    raw.identity = b"rank-5"
    set_curve_client(raw, load_job_keys(job[0], 5))
    raw.connect(server.endpoint)
    try:
        raw.send_multipart([b"\x7f", b"\x01", b""])
        raw.send_multipart([b"\x02", b"\x01", b"\xc1"])
        raw.send_multipart(encode(Heartbeat(rank=5, sent_at=2.0)))
        assert server.recv(timeout_s=ARRIVE_S) == (b"rank-5", Heartbeat(rank=5, sent_at=2.0))
    finally:
        raw.close()
        ctx.term()
    # both dropped; one line a minute per sender, the second is held back (counted in the next)
    assert (server.drops.malformed, server.drops.total) == (2, 2)
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert dropped == ["bus: dropped a message from b'rank-5': unknown message kind b'\\x7f'"]


def test_send_to_an_unknown_identity_raises_a_clear_error(server: BusServer) -> None:
    with pytest.raises(BusSendError, match=r"cannot send Shutdown to b'rank-99': no such peer"):
        server.send(rank_identity(99), Shutdown(seq=0, reason="x"))


def test_a_killed_rank_is_declared_dead(server: BusServer,
                                       job: tuple[Path, ServerKeys]) -> None:
    monitor = HeartbeatMonitor(interval_s=0.02, misses=5)  # dead after 0.1 s of silence
    proc = _peer("heartbeat", server.endpoint, job[0])
    try:
        got = _recv_from(server, proc)
        monitor.beat(got[1].rank, now=time.monotonic())
        assert monitor.alive() == [3]
        proc.kill()
        proc.wait(5)
        dead: list[int] = []
        deadline = time.monotonic() + ARRIVE_S  # 0.1 s of silence after the last beat read
        while not dead and time.monotonic() < deadline:
            got = server.recv(timeout_s=0.02)
            if got is not None:
                monitor.beat(got[1].rank, now=time.monotonic())
            dead = monitor.dead(now=time.monotonic())
        assert dead == [3] and monitor.alive() == []
    finally:
        proc.kill()
        proc.wait(5)


def test_an_unauthenticated_server_binds_loopback_only() -> None:
    with pytest.raises(BusError, match=r"refusing to bind 0\.0\.0\.0 without CURVE keys"):
        BusServer(None, host="0.0.0.0")
