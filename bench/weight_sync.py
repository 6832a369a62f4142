"""Weight sync: the weight feed (each receiver on its own TCP connection to the source) beside a
gloo broadcast of the same buckets, from rank 0 to 1 and to 3 receivers, in one run.

    python bench/weight_sync.py [--out bench/results/weight_sync.json] [--reps 3]

Payloads: the tiny and small model state dicts and a 256 MiB synthetic state (32 fp32 matrices
of 8 MiB, each followed by a 4 KiB vector, as weights and biases/norms alternate in a model).
Both transports cut the layout into the same buckets (``plan_buckets``, 16 MiB, the feed's). Each
sync starts after a barrier; its time is the slowest rank's: for the feed, the source's publish
(the copy into its buffers) then every receiver's fetch, all at once; for the broadcast, packing,
the broadcasts and unpacking. The figure is the median GB/s (payload bytes / time) of ``--reps``
repetitions after one warm-up. Each rank runs on one thread, as the trainer ranks do.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info, write_result

from tiderl.models.random_init import init_model
from tiderl.trainer.spawn import RankContext, run_ranks
from tiderl.trainer.sync import param_layout, plan_buckets, state_layout, unpack_bucket
from tiderl.trainer.weight_feed import (
    FEED_BUCKET_BYTES,
    WEIGHTS,
    WeightFeed,
    check_state,
    fetch,
    fill_bucket,
)

PAYLOADS = ("tiny", "small", "synthetic-256MiB")
RECEIVERS = (1, 3)
TOKEN = "bench"


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


def pack_copy(layout, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """``state`` as the layout's buckets in new buffers, as the feed's source copies them."""
    check_state(layout, state)
    flats = []
    for bucket in plan_buckets(layout, FEED_BUCKET_BYTES):
        flats.append(torch.empty(bucket.numel, dtype=bucket.dtype))
        fill_bucket(bucket, state, flats[-1])
    return flats


def _broadcast(state: dict[str, torch.Tensor], layout, is_src: bool) -> None:
    """The same buckets in one gloo broadcast each (the source packs them as the feed does)."""
    buckets = plan_buckets(layout, FEED_BUCKET_BYTES)
    flats = pack_copy(layout, state) if is_src else [
        torch.empty(bucket.numel, dtype=bucket.dtype) for bucket in buckets]
    for bucket, flat in zip(buckets, flats, strict=True):
        dist.broadcast(flat, src=0)
        if not is_src:
            unpack_bucket(bucket, flat)


def _rank(ctx: RankContext, reps: int) -> list[dict]:
    """Every rank builds the payload (a receiver only needs its layout, as from its model)."""
    is_src = ctx.rank == 0
    feed = WeightFeed(TOKEN, host="127.0.0.1") if is_src else None
    ports = [feed.port if feed else 0]
    dist.broadcast_object_list(ports, src=0)
    rows, version = [], 0
    for name in PAYLOADS:
        state = payload(name)
        layout = state_layout(state)
        for transport in ("feed", "broadcast"):
            seconds = []
            for _ in range(reps + 1):  # the first is a warm-up
                version += 1
                dist.barrier()
                start = time.perf_counter()
                if transport == "broadcast":
                    _broadcast(state, layout, is_src)
                elif feed is not None:
                    feed.publish(version, {WEIGHTS: (layout, state)})
                else:
                    fetch(f"127.0.0.1:{ports[0]}", version, layout, token=TOKEN)
                seconds.append(time.perf_counter() - start)
            rows.append({"payload": name, "transport": transport, "seconds": seconds[1:],
                         "num_bytes": sum(t.numel() * t.element_size() for t in state.values()),
                         "num_tensors": len(layout),
                         "num_buckets": len(plan_buckets(layout, FEED_BUCKET_BYTES))})
    dist.barrier()  # every fetch is done before the source closes its feed
    if feed is not None:
        feed.close()
    return rows


def run_bench(reps: int) -> dict:
    rows = []
    for receivers in RECEIVERS:
        per_rank = run_ranks(_rank, receivers + 1, reps, timeout_s=900)
        for by_rank in zip(*per_rank, strict=True):
            first = by_rank[0]
            # the feed's source returns after publishing: the sync ends with the last fetch
            seconds = [max(row["seconds"][i] for row in by_rank)
                       for i in range(len(first["seconds"]))]
            gb_per_s = [first["num_bytes"] / s / 1e9 for s in seconds]
            rows.append({**first, "receivers": receivers,
                         "seconds": [round(s, 5) for s in seconds],
                         "gb_per_s": [round(g, 3) for g in gb_per_s],
                         "median_gb_per_s": round(statistics.median(gb_per_s), 3)})
    return {"benchmark": "weight_sync",
            "transport": "weight feed (TCP, a connection per receiver) vs gloo broadcast, "
                         "processes on 127.0.0.1",
            "bucket_bytes": FEED_BUCKET_BYTES, "reps": reps, "rows": rows,
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
