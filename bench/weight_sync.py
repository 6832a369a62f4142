"""Weight sync: ``sync_params`` from rank 0 to rank 1 (two processes, gloo over loopback).

    python bench/weight_sync.py [--out bench/results/weight_sync.json] [--reps 3]

Payloads: the tiny and small model state dicts and a 256 MiB synthetic state (32 fp32 matrices
of 8 MiB, each followed by a 4 KiB vector, as weights and biases/norms alternate in a model).
Bucket sizes 4 MiB, 64 MiB and 0 (one broadcast per tensor). Each sync starts after a barrier;
its time is the slower rank's ``SyncResult.seconds`` (packing, header, broadcasts, unpacking),
and the figure is the median GB/s (1e9 bytes/s) of ``--reps`` repetitions after one warm-up.
Each rank runs on one thread, as the trainer ranks do.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info, write_result

from tiderl.models.random_init import init_model
from tiderl.trainer.spawn import RankContext, run_ranks
from tiderl.trainer.sync import param_layout, plan_buckets, state_layout, sync_params

MIB = 1 << 20
BUCKET_SIZES = {"4MiB": 4 * MIB, "64MiB": 64 * MIB, "per-tensor": 0}
PAYLOADS = ("tiny", "small", "synthetic-256MiB")


def synthetic_state() -> dict[str, torch.Tensor]:
    state = {}
    for i in range(32):
        state[f"layers.{i:02d}.weight"] = torch.randn(2048, 1024)
        state[f"layers.{i:02d}.norm"] = torch.randn(1024)
    return state


def payload(name: str) -> dict[str, torch.Tensor]:
    if name == "synthetic-256MiB":
        return synthetic_state()
    model = init_model(name)
    names = {entry[0] for entry in param_layout(model)}  # a tied lm_head is not sent
    return {key: tensor for key, tensor in model.state_dict().items() if key in names}


def _rank(ctx: RankContext, reps: int) -> list[dict]:
    """Every rank builds the payload (the receiver only needs its layout, as from its model)."""
    rows = []
    for name in PAYLOADS:
        state = payload(name)
        layout = state_layout(state)
        for label, bucket_bytes in BUCKET_SIZES.items():
            seconds = []
            for _ in range(reps + 1):  # the first is a warm-up
                dist.barrier()
                result = sync_params(state if ctx.rank == 0 else None, layout,
                                     1 if ctx.rank == 0 else None, src=0,
                                     bucket_bytes=bucket_bytes)
                seconds.append(result.seconds)
            rows.append({"payload": name, "bucket": label, "bucket_bytes": bucket_bytes,
                         "num_bytes": result.num_bytes, "num_tensors": len(layout),
                         "num_buckets": len(plan_buckets(layout, bucket_bytes)),
                         "seconds": seconds[1:]})
    return rows


def run_bench(reps: int) -> dict:
    per_rank = run_ranks(_rank, 2, reps, timeout_s=600)
    rows = []
    for sender, receiver in zip(*per_rank, strict=True):
        seconds = [max(a, b) for a, b in zip(sender["seconds"], receiver["seconds"], strict=True)]
        gb_per_s = [sender["num_bytes"] / s / 1e9 for s in seconds]
        rows.append({**sender, "seconds": [round(s, 5) for s in seconds],
                     "gb_per_s": [round(g, 3) for g in gb_per_s],
                     "median_gb_per_s": round(statistics.median(gb_per_s), 3)})
    return {"benchmark": "weight_sync", "transport": "gloo, 2 processes on 127.0.0.1",
            "reps": reps, "rows": rows,
            "machine": machine_info() | {"torch": torch.__version__, "torch_threads": 1},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out",
                        default=str(Path(__file__).parent / "results" / "weight_sync.json"))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    write_result(args.out, run_bench(args.reps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
