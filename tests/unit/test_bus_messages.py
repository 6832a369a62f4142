"""Bus wire format (round trips, exact frames, one-line errors) and the heartbeat monitor."""

from __future__ import annotations

import msgspec
import pytest

from tiderl.core.config import ConfigError
from tiderl.core.system import StepMode
from tiderl.runtime.bus import (
    MESSAGES,
    SCHEMA_VERSION,
    AbortStep,
    Ack,
    AdmitTask,
    BusProtocolError,
    CarryData,
    DetachTask,
    Heartbeat,
    HeartbeatMonitor,
    Hello,
    MicroBatchData,
    PauseTask,
    RankMetrics,
    Rebalance,
    RebalanceReply,
    ResumeTask,
    Shutdown,
    Snapshot,
    StepClosed,
    StepDone,
    StepFailed,
    SyncWeights,
    TaskDetached,
    TaskFinished,
    TrainSampleData,
    TrainStep,
    TurnData,
    TurnReport,
    decode,
    encode,
)

METRICS = RankMetrics(rank=2, role="rollout", kv_tokens_used=900, kv_tokens_capacity=4096,
                      prefix_hit_rate=0.75, running=3, waiting=1)
EXAMPLES = [
    Hello(rank=1, pid=4242, host="node-a", role="rollout", device="cuda:1"),
    Heartbeat(rank=1, sent_at=1700000000.25),
    TurnReport(rank=1, task_id="t-7", tokens=31, context_tokens=812, done=False, version=4),
    TaskFinished(rank=1, task_id="t-7", group_id="g-2", reward=1.0, num_tokens=9,
                 turns=[TurnData(context_ids=[1, 2], output_ids=[3], logprobs=[-0.5], version=3),
                        TurnData(context_ids=[1, 2, 3, 4], output_ids=[5, 6],
                                 logprobs=[-0.25, -1.5], version=4)]),
    TaskDetached(rank=1, task_id="t-7", carry=CarryData(
        session="s9", next_context=[7, 8],
        turns=[TurnData(context_ids=[1, 2], output_ids=[3], logprobs=[-0.5], version=3)])),
    Ack(rank=1, ref=17, ok=False, error="no such task"),
    StepDone(rank=3, step=5, version=6, step_mode="decoupled", loss=0.125, loss_tokens=4096,
             grad_norm=0.75, seconds=2.5, stats={"kl": 0.01}, attempt=1),
    StepFailed(rank=3, step=5, attempt=0, updated=False,
               error="Connection closed by peer"),
    METRICS,
    AdmitTask(seq=1, task_id="t-8", group_id="g-2", env="guess", task="1 16", seed=99, eval=True,
          pin=True, carry=CarryData(session="s9", turns=[], next_context=[4])),
    PauseTask(seq=2, task_id="t-8"),
    ResumeTask(seq=3, task_id="t-8"),
    DetachTask(seq=4, task_id="t-8"),
    SyncWeights(seq=5, version=6, src_rank=3, roles=["rollout", "ref", "actor"], members=[0, 1, 2],
                joiners=[2], checkpoint="runs/j/checkpoints"),
    TrainStep(seq=7, step=5, step_mode=StepMode.DECOUPLED, ref_ranks=[2], actor_ranks=[3, 4],
              max_aggregate=4, attempt=1),
    MicroBatchData(seq=8, step=5, mb_id=0, attempt=1,
                   samples=[TrainSampleData(seq_id="s0", input_ids=[1, 2, 3], loss_mask=[0, 1, 1],
                                            logprobs=[-0.5, -0.25], advantage=-1.5, version=5)]),
    StepClosed(seq=9, step=5, attempt=1),
    AbortStep(seq=10, step=5, attempt=0),
    Shutdown(seq=8, reason="job done"),
    Snapshot(step=5, time=12.5, roles={0: "rollout", 3: "actor"},
             metrics={"goodput_tok_s": 812.5}, ranks=[METRICS], ctb_budgets={2: 3686}),
    Rebalance(seq=1, rollout=2, trainer=1, placement="colocated"),
    RebalanceReply(ref=1, status="applied", reason="", step=4, version=5,
                   roles=["rollout", "actor", "rollout"], placement="colocated"),
]


def test_every_message_type_has_an_example_and_a_unique_kind_byte() -> None:
    assert sorted(type(m).__name__ for m in EXAMPLES) == sorted(c.__name__ for c in MESSAGES)
    kinds = [cls.kind for cls in MESSAGES]
    assert len(set(kinds)) == len(kinds)
    assert all(0 <= kind <= 0xFF for kind in kinds)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_is_exact(msg: msgspec.Struct) -> None:
    frames = encode(msg)
    assert frames[:2] == [bytes([type(msg).kind]), bytes([SCHEMA_VERSION])]
    assert decode(frames) == msg
    assert type(decode(frames)) is type(msg)


def test_payload_is_a_plain_msgpack_map_of_the_fields() -> None:
    payload = encode(Heartbeat(rank=3, sent_at=0.5))[2]
    assert msgspec.msgpack.decode(payload) == {"rank": 3, "sent_at": 0.5}


def test_defaults_and_frozen() -> None:
    assert Ack(rank=0, ref=1, ok=True).error == ""
    assert AdmitTask(seq=0, task_id="t", group_id="g", env="e", seed=0).eval is False
    with pytest.raises(AttributeError):
        PauseTask(seq=0, task_id="t").seq = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        PauseTask(0, "t")  # type: ignore[misc]  # kw_only: positional calls are refused


def test_rebalance_defaults_and_kind_ranges() -> None:
    """The CLI's request carries no rank (it is not a rank's message); kinds stay in the
    direction ranges (0x01-0x1f to the coordinator, 0x20-0x3f from it)."""
    auto = Rebalance(seq=3, auto=True)
    assert (auto.rollout, auto.trainer, auto.placement) == (0, 0, "")
    assert not hasattr(auto, "rank")
    assert RebalanceReply(ref=3, status="refused", reason="x").roles == []
    assert 0x01 <= Rebalance.kind <= 0x1F and 0x20 <= RebalanceReply.kind <= 0x3F
    assert msgspec.msgpack.decode(encode(auto)[2]) == {
        "seq": 3, "rollout": 0, "trainer": 0, "placement": "", "auto": True}


@pytest.mark.parametrize("mode", list(StepMode), ids=lambda m: m.value)
def test_a_train_step_carries_its_step_mode_by_value(mode: StepMode) -> None:
    msg = TrainStep(seq=1, step=0, step_mode=mode, ref_ranks=[], actor_ranks=[0, 1],
                    max_aggregate=0)
    assert msgspec.msgpack.decode(encode(msg)[2])["step_mode"] == mode.value
    got = decode(encode(msg))
    assert got.step_mode is mode


def test_an_unknown_step_mode_is_a_bad_payload() -> None:
    payload = {"seq": 1, "step": 0, "step_mode": "sideways", "ref_ranks": [], "actor_ranks": [0],
               "max_aggregate": 1}
    with pytest.raises(BusProtocolError,
                       match=r"TrainStep \(kind 0x25\): bad payload: .*\$\.step_mode"):
        decode(_frames(TrainStep.kind, payload))


def test_a_snapshot_without_ctb_budgets_has_none() -> None:
    assert Snapshot(step=0, time=0.0, roles={}, metrics={}, ranks=[]).ctb_budgets == {}


def _frames(kind: int, payload: object, version: int = SCHEMA_VERSION) -> list[bytes]:
    return [bytes([kind]), bytes([version]), msgspec.msgpack.encode(payload)]


HELLO = {"rank": 1, "pid": 2, "host": "h", "role": "rollout", "device": "cpu"}


@pytest.mark.parametrize(("frames", "message"), [
    (_frames(0x7F, HELLO), "unknown message kind b'\\x7f'"),
    ([b"\x01\x01", b"\x01", b""], "unknown message kind"),
    (_frames(0x01, HELLO, version=1),
     "Hello (kind 0x01): schema version 1, expected 2"),
    ([b"\x01", bytes([SCHEMA_VERSION]), b"\xc1"],
     "Hello (kind 0x01): bad payload: MessagePack data is malformed"),
    (_frames(0x01, {**HELLO, "rank": "one"}),
     "Hello (kind 0x01): bad payload: Expected `int`, got `str` - at `$.rank`"),
    (_frames(0x01, {**HELLO, "extra": 1}), "unknown field `extra`"),
    (_frames(0x01, {"rank": 1}), "missing required field `pid`"),
    ([b"\x01", b"\x01"], "expected 3 frames [kind, version, payload], got 2"),
], ids=["unknown-kind", "two-byte-kind", "version", "not-msgpack", "wrong-type", "unknown-field",
        "missing-field", "frame-count"])
def test_malformed_frames_raise_one_clear_line(frames: list[bytes], message: str) -> None:
    with pytest.raises(BusProtocolError) as info:
        decode(frames)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_10_mb_kind_frame_is_one_bounded_line() -> None:
    with pytest.raises(BusProtocolError) as info:
        decode([b"\x7f" * 10_000_000, bytes([SCHEMA_VERSION]), b""])
    message = str(info.value)
    assert message.startswith("unknown message kind b'\\x7f") and len(message) < 300
    assert message.endswith("… (10,000,000 bytes)")


def test_nested_structs_are_not_messages() -> None:
    with pytest.raises(TypeError, match="TurnData is not a bus message"):
        encode(TurnData(context_ids=[], output_ids=[], logprobs=[], version=0))  # type: ignore[arg-type]


def test_heartbeat_monitor_declares_each_death_once_and_revives() -> None:
    monitor = HeartbeatMonitor(interval_s=1.0, misses=3)  # dead after > 3 s of silence
    monitor.beat(0, now=0.0)
    monitor.beat(1, now=0.0)
    assert monitor.dead(now=3.0) == []  # exactly at the timeout: still alive
    monitor.beat(1, now=2.5)
    assert monitor.dead(now=3.5) == [0]
    assert monitor.alive() == [1]
    assert monitor.dead(now=4.0) == []  # reported once
    assert monitor.dead(now=9.0) == [1]
    assert monitor.alive() == []
    assert monitor.beat(0, now=10.0) is True  # revived
    assert monitor.beat(0, now=10.5) is False
    assert monitor.alive() == [0]
    assert monitor.dead(now=13.6) == [0]  # and can die again


def test_heartbeat_monitor_validates_its_config() -> None:
    with pytest.raises(ConfigError, match="heartbeat_s"):
        HeartbeatMonitor(interval_s=0.0, misses=3)
    with pytest.raises(ConfigError, match="heartbeat_misses"):
        HeartbeatMonitor(interval_s=1.0, misses=0)
