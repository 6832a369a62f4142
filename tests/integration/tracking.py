"""Reading a job's experiment-tracking output back with each tool's own code: TensorBoard's
EventAccumulator, and wandb's protobuf records of an offline run's ``.wandb`` file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest


def offline_wandb(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """wandb offline and quiet, its user folders under ``home`` (a test writes nothing in ~);
    the job's processes inherit it."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files in ``logdir``: its (step, value) points."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def as_float32(value: float) -> float:
    """A value as a TensorBoard scalar holds it (simple_value is a float32)."""
    return float(np.float32(value))


def wandb_history(run_file: Path) -> list[tuple[int, dict[str, object]]]:
    """The (step, values) of each history record of a ``run-*.wandb`` file. The file is a
    LevelDB-style log (32 KiB blocks; each chunk: crc32c, length, type; a record is one FULL
    chunk or FIRST..LAST) after a 7-byte ':W&B' header, of wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    history, chunk, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if length == 0 and kind == 0:  # a block's zero padding
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                history.append((record.history.step.num,
                                {k: v for k, v in items.items() if not k.startswith("_")}))
    return history
