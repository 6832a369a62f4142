"""Bus fuzz: a real CurveZMQ BusServer under a seeded flood of malformed and forbidden messages.

    python bench/robustness_bus.py [--count 1000] [--seed 0]     prints the counts as JSON

    flooder  DEALER id=rank-0, rank 0's key ──count bad messages──┐
             then one valid Heartbeat (its messages arrive in order) ├─► BusServer.recv()
    rank 1   DEALER id=rank-1, rank 1's key ──valid Heartbeat─────┤   (drops counted by why)
    intruder DEALER id=rank-2, a key of no job ──Heartbeat────────┤   ZAP: refused
    plain    DEALER id=rank-2, no CURVE ──Heartbeat───────────────┘   handshake: failed

Each bad message is one of the kinds of :data:`KINDS`, every one of them a message a rank key
may not get through: random payloads, wrong frame counts, unknown kinds, other schema versions,
wrong field types (every field of every rank message), huge values and declared lengths,
msgpack bombs (deep nesting, containers that claim 2^32 entries, 1 MiB of noise), and
well-formed messages the key may not send (another rank's, the operator's, the coordinator's).

Import it as ``bench.robustness_bus`` with the repository root on ``sys.path`` (``bench/`` is a
namespace package; ``bench/robustness.py`` does so), or as ``robustness_bus`` from ``bench/``:
it imports only tiderl.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from tiderl.runtime.bus import (
    MESSAGES,
    RANK_MESSAGES,
    SCHEMA_VERSION,
    Ack,
    AdmitTask,
    BusClient,
    BusServer,
    CarryData,
    Heartbeat,
    Hello,
    JobKeys,
    Message,
    RankMetrics,
    Rebalance,
    Shutdown,
    Snapshot,
    StepDone,
    StepFailed,
    TaskDetached,
    TaskFinished,
    TurnData,
    TurnReport,
    encode,
    load_job_keys,
    make_job_keys,
    rank_identity,
    set_curve_client,
)

RANK = 0  # the flooder's key and identity
DEADLINE_S = 60.0  # for the valid messages after the flood and the intruders' rejections
NOISE_BYTES = 1 << 20
_TURN = TurnData(context_ids=[1, 2], output_ids=[3], logprobs=[-0.5], version=1)
TEMPLATES: tuple[Message, ...] = (  # one valid message of rank 0 per rank kind
    Hello(rank=RANK, pid=1, host="h", role="rollout", device="cpu"),
    Heartbeat(rank=RANK, sent_at=1.0),
    TurnReport(rank=RANK, task_id="t", tokens=1, context_tokens=2, done=False, version=1),
    TaskFinished(rank=RANK, task_id="t", group_id="g", reward=1.0, turns=[_TURN], num_tokens=3),
    TaskDetached(rank=RANK, task_id="t", carry=CarryData(session="s", turns=[_TURN],
                                                          next_context=[1])),
    Ack(rank=RANK, ref=1, ok=True),
    StepDone(rank=RANK, step=0, version=1, step_mode="colocated", loss=0.5, loss_tokens=4,
             grad_norm=1.0, seconds=0.1, stats={"kl": 0.0}),
    StepFailed(rank=RANK, step=0, attempt=0, updated=False, error="closed"),
    RankMetrics(rank=RANK, role="rollout", kv_tokens_used=1, kv_tokens_capacity=8,
                prefix_hit_rate=0.5, running=1, waiting=0),
)
if {type(m) for m in TEMPLATES} != set(RANK_MESSAGES):
    raise RuntimeError("robustness_bus.TEMPLATES: one valid message per rank kind, please")
_KNOWN_KINDS = {m.kind for m in MESSAGES}
_VERSION = bytes([SCHEMA_VERSION])
_WRONG_VALUES = ("0", 0.5, -1, None, [], {}, True, b"\x00", 2**64 - 1, "x" * 1000)


def _other_types(value: object) -> list[object]:
    """Values msgspec does not take in place of ``value`` (an int is a valid float)."""
    kinds = (int, float) if type(value) is float else (type(value),)
    return [v for v in _WRONG_VALUES if type(v) not in kinds]


def _frames(msg: Message, payload: bytes) -> list[bytes]:
    return [bytes([msg.kind]), _VERSION, payload]


def _fields(msg: Message) -> dict:
    return msgspec.to_builtins(msg)


def random_payload(rng: random.Random) -> list[bytes]:
    """A rank kind and the schema version, then random bytes."""
    return _frames(rng.choice(TEMPLATES), rng.randbytes(rng.randrange(0, 256)))


def wrong_frame_count(rng: random.Random) -> list[bytes]:
    frames = encode(rng.choice(TEMPLATES))
    if rng.random() < 0.5:
        return frames[:rng.randrange(1, 3)]  # a frame or two short
    return frames + [rng.randbytes(rng.randrange(0, 16)) for _ in range(rng.randrange(1, 5))]


def unknown_kind(rng: random.Random) -> list[bytes]:
    frames = encode(rng.choice(TEMPLATES))
    kind = rng.choice([b"", bytes([rng.choice([k for k in range(256) if k not in _KNOWN_KINDS])]),
                       rng.randbytes(rng.randrange(2, 8))])
    return [kind, *frames[1:]]


def other_version(rng: random.Random) -> list[bytes]:
    frames = encode(rng.choice(TEMPLATES))
    version = rng.choice([b"", bytes([rng.choice([v for v in range(256) if v != SCHEMA_VERSION])]),
                          _VERSION + b"\x00", rng.randbytes(4)])
    return [frames[0], version, frames[2]]


def wrong_field_type(rng: random.Random) -> list[bytes]:
    """One field of a valid message replaced by a value of another type, dropped, or added."""
    msg = rng.choice(TEMPLATES)
    fields = _fields(msg)
    name = rng.choice(sorted(fields))
    action = rng.random()
    if action < 0.7:
        fields[name] = rng.choice(_other_types(fields[name]))
    elif action < 0.85:
        del fields[name]  # a required field missing (or a default one: then a wrong one too)
        fields["rank"] = str(RANK)
    else:
        fields["unknown_field"] = 1  # forbid_unknown_fields
    payload = msgspec.msgpack.encode(fields if rng.random() < 0.9 else list(fields.values()))
    return _frames(msg, payload)


def huge_value(rng: random.Random) -> list[bytes]:
    """Huge numbers where only the key's own rank passes, and lengths far past the data."""
    msg = rng.choice(TEMPLATES)
    if rng.random() < 0.5:
        fields = _fields(msg)
        fields["rank"] = rng.choice([2**64 - 1, 2**63, -(2**63), 10**18])
        return _frames(msg, msgspec.msgpack.encode(fields))
    header = rng.choice([b"\xdb", b"\xc6", b"\xdd", b"\xdf"])  # str32 bin32 array32 map32
    return _frames(msg, header + b"\xff\xff\xff\xff" + rng.randbytes(rng.randrange(0, 64)))


def msgpack_bomb(rng: random.Random) -> list[bytes]:
    """Deep nesting in a field, containers claiming 2^32 entries, or 1 MiB of noise."""
    msg = rng.choice(TEMPLATES)
    pick = rng.randrange(3)
    if pick == 0:
        depth = rng.choice([1_000, 100_000])
        nested = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
        field = rng.choice(sorted(_fields(msg))).encode()
        payload = b"\x81" + msgspec.msgpack.encode(field.decode()) + nested
    elif pick == 1:
        payload = b"\x81\xa5turns\xdd\xff\xff\xff\xff" + b"\x80" * rng.randrange(1, 64)
    else:
        payload = b"\xdf\x00\x00\x00\x01" + rng.randbytes(NOISE_BYTES)
    return _frames(msg, payload)


def not_this_keys_to_send(rng: random.Random) -> list[bytes]:
    """Well-formed, but another rank's, the operator's or the coordinator's to send."""
    other = msgspec.structs.replace(rng.choice(TEMPLATES), rank=rng.choice([1, 2, 99]))
    return encode(rng.choice([
        other, Rebalance(seq=1, rollout=1, trainer=1), Shutdown(seq=1, reason="x"),
        AdmitTask(seq=1, task_id="t", group_id="g", env="guess", seed=0),
        Snapshot(step=0, time=0.0, roles={}, metrics={}, ranks=[])]))


KINDS: dict[str, Callable[[random.Random], list[bytes]]] = {
    "random_payload": random_payload, "wrong_frame_count": wrong_frame_count,
    "unknown_kind": unknown_kind, "other_version": other_version,
    "wrong_field_type": wrong_field_type, "huge_value": huge_value,
    "msgpack_bomb": msgpack_bomb, "not_this_keys_to_send": not_this_keys_to_send,
}


def fuzz_bus(count: int = 1000, seed: int = 0) -> dict:
    """Flood a real BusServer with ``count`` bad messages (seeded), let two intruders knock, and
    count what happened: ``sent``, ``dropped`` (and by why), ``delivered_bad`` (bad messages
    that came through: 0), ``delivered_valid_after`` of ``valid_sent_after``, ``rejected_peers``
    (of the 2 intruders), ``by_kind``, ``seconds``."""
    if count < 1:
        raise ValueError(f"fuzz_bus: count must be >= 1, got {count}")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp, \
            BusServer(make_job_keys(Path(tmp) / "keys", 2)) as server:
        keys_dir = Path(tmp) / "keys"
        begin = time.monotonic()
        ctx = zmq.Context()
        try:
            intruders = _knock(ctx, server, load_job_keys(keys_dir, 0).server_public)
            flooder = _raw_peer(ctx, server, load_job_keys(keys_dir, RANK))
            by_kind: Counter[str] = Counter()
            for _ in range(count):
                kind = rng.choice(sorted(KINDS))
                by_kind[kind] += 1
                flooder.send_multipart(KINDS[kind](rng))
            last = Heartbeat(rank=RANK, sent_at=-1.0)  # after every bad one, on the same pipe
            flooder.send_multipart(encode(last))
            with BusClient(server.endpoint, load_job_keys(keys_dir, 1), rank_identity(1)) as one:
                one.send(Heartbeat(rank=1, sent_at=-1.0))
                valid = [(rank_identity(RANK), last),
                         (rank_identity(1), Heartbeat(rank=1, sent_at=-1.0))]
                delivered_valid, delivered_bad = _collect(server, valid)
            rejected = _rejected(server)
            del intruders
        finally:
            ctx.destroy(linger=0)  # the flooder and the intruders
        return {"sent": count, "dropped": server.drops.total,
                "dropped_malformed": server.drops.malformed,
                "dropped_forged": server.drops.forged,
                "dropped_forbidden": server.drops.forbidden,
                "delivered_bad": delivered_bad, "delivered_valid_after": delivered_valid,
                "valid_sent_after": len(valid), "rejected_peers": rejected,
                "by_kind": dict(sorted(by_kind.items())),
                "seconds": round(time.monotonic() - begin, 2)}


def _raw_peer(ctx: zmq.Context, server: BusServer, keys: JobKeys) -> zmq.Socket:
    """A DEALER with a valid rank key that writes frames by hand (nothing it queues is lost)."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = 0
    sock.identity = keys.peer.encode()
    set_curve_client(sock, keys)
    sock.connect(server.endpoint)
    return sock


def _knock(ctx: zmq.Context, server: BusServer, server_public: bytes) -> list[zmq.Socket]:
    """A peer with a key of no job (it knows the server's public key) and a plain one, both
    claiming rank 2's identity and sending its Heartbeat."""
    stranger = ctx.socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    set_curve_client(stranger, JobKeys(server_public, "rank-2", public, secret))
    plain = ctx.socket(zmq.DEALER)
    for sock in (stranger, plain):
        sock.linger = 0
        sock.identity = rank_identity(2)
        sock.connect(server.endpoint)
        sock.send_multipart(encode(Heartbeat(rank=2, sent_at=0.0)), zmq.NOBLOCK)
    return [stranger, plain]  # held until the end: a socket collected is a socket closed


def _collect(server: BusServer, valid: list) -> tuple[int, int]:
    """Receive until every ``valid`` message came (or DEADLINE_S); (valid, other) delivered."""
    waiting, num_bad = list(valid), 0  # a list: a message with a dict field is unhashable
    deadline = time.monotonic() + DEADLINE_S
    while waiting and (left := deadline - time.monotonic()) > 0:
        got = server.recv(timeout_s=left)
        if got is None:
            break
        if got in waiting:
            waiting.remove(got)
        else:
            num_bad += 1
    while (got := server.recv(timeout_s=0.2)) is not None:  # anything trailing is bad too
        num_bad += 1
    return len(valid) - len(waiting), num_bad


def _rejected(server: BusServer) -> int:
    """How many of the two intruders the gatekeeper turned away (waits up to DEADLINE_S)."""
    gate = server.gatekeeper
    assert gate is not None
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        rejected = (gate.num_refused_keys > 0) + (gate.num_failed_handshakes > 0)
        if rejected == 2:
            return rejected
        time.sleep(0.05)
    return rejected


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(fuzz_bus(args.count, args.seed), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
