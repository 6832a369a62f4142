"""The ZeroMQ bus between the coordinator, the rank daemons and ``tiderl top`` (CurveZMQ)."""

from tiderl.runtime.bus.heartbeat import HeartbeatMonitor
from tiderl.runtime.bus.keys import BusKeyError, JobKeys, load_job_keys, make_job_keys
from tiderl.runtime.bus.messages import (
    MESSAGES,
    SCHEMA_VERSION,
    Ack,
    Admit,
    BusProtocolError,
    Detach,
    Heartbeat,
    Hello,
    Message,
    MicroBatchData,
    Pause,
    RankMetrics,
    Rebalance,
    RebalanceReply,
    Resume,
    Shutdown,
    Snapshot,
    StepClosed,
    StepDone,
    SyncWeights,
    TaskCarry,
    TaskDetached,
    TaskFinished,
    TrainSampleData,
    TrainStep,
    TurnData,
    TurnReport,
    decode,
    encode,
)
from tiderl.runtime.bus.sockets import (
    BusClient,
    BusError,
    BusSendError,
    BusServer,
    Subscriber,
    rank_identity,
    set_curve_client,
    set_curve_server,
)

__all__ = [
    "MESSAGES", "SCHEMA_VERSION", "Ack", "Admit", "BusClient", "BusError", "BusKeyError",
    "BusProtocolError", "BusSendError", "BusServer", "Detach", "Heartbeat", "HeartbeatMonitor",
    "Hello",
    "JobKeys", "Message", "MicroBatchData", "Pause", "RankMetrics", "Rebalance",
    "RebalanceReply", "Resume", "Shutdown",
    "Snapshot", "StepClosed", "StepDone", "Subscriber", "SyncWeights", "TaskCarry",
    "TaskDetached", "TaskFinished",
    "TrainSampleData", "TrainStep", "TurnData", "TurnReport", "decode", "encode",
    "load_job_keys", "make_job_keys", "rank_identity", "set_curve_client", "set_curve_server",
]
