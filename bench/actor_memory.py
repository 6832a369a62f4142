"""An actor rank's resident set over many steps: a leak, or the C allocator keeping freed memory?

One process per variant, each the same seeded steps through a trainer rank's path: the tiny
model as the ``local`` profile's actor (DDP over a one-rank gloo world, AdamW, ``kl_beta`` 0.01
with a Ref model), the colocated executor, a ``StreamedStep`` fed from the main thread and the
step run in a worker thread (as the rank's ``asyncio.to_thread``). A step: ``--samples``
sequences of 100..900 tokens (12 context/output turns each), packed by RA2P into micro-batches of
``tokens_per_rank`` 2048 (the profile's), so every micro-batch has another shape.

Recorded per variant: VmRSS after every step (at the end of the step, after the actor's
``optimizer_step``), glibc's own account at steps 0/20/50/100/150 (``mallinfo2``: bytes in its
heaps, in use, free), the live ``torch.Tensor`` and gc-tracked objects there, the peak RSS and
the median step time (wall, and CPU: the machine's cores are shared) and minor page faults.
The ``glibc`` variant also traces Python allocations from step 20 on
(``tracemalloc``) and reports the lines whose retained memory grew most by the last step.

Variants: ``glibc`` (the default allocator, no trim: the trainer before the fix),
``arena_max_2`` (``MALLOC_ARENA_MAX=2``), ``trim_threshold_128k`` (``MALLOC_TRIM_THRESHOLD_``:
static thresholds, the mmap threshold stays at 128 KiB), ``mmap_threshold_64k``
(``MALLOC_MMAP_THRESHOLD_=65536``), ``malloc_trim`` (``ActorWorker``'s default,
``release_every=1``: ``malloc_trim(0)`` after each optimizer step), ``malloc_trim_every_8``
and ``jemalloc`` (``LD_PRELOAD``, where libjemalloc2 is installed).

Run: ``.venv/bin/python bench/actor_memory.py [--steps 151] [--samples 10] [--variants ...]
[--append]`` (about 5 minutes a variant on one idle core; CPU seconds and page faults are the
figures to compare when the machine is shared).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info, write_result

from tiderl.core.ra2p import form_micro_batches
from tiderl.core.system import StepMode
from tiderl.models.random_init import init_model
from tiderl.models.vocab import VOCAB
from tiderl.trainer.config import TrainerConfig
from tiderl.trainer.executors import ColocatedExecutor, StreamedStep
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.synthetic import synthetic_samples
from tiderl.trainer.worker import ActorWorker, RefWorker

RESULT = Path(__file__).parent / "results" / "actor_memory.json"
JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
TOKENS_PER_RANK = 2048  # profiles/local.yaml's ra2p.tokens_per_rank
MIN_TOKENS, MAX_TOKENS, TURNS = 100, 900, 12
CHECKPOINTS = (0, 20, 50, 100, 150)
TRACE_FROM = 20
CONFIG = TrainerConfig(lr=1e-2, kl_beta=0.01)  # the local profile's trainer section
# name -> (environment, ActorWorker's release_every: malloc_trim(0) after every n-th step, 0 never)
VARIANTS = {
    "glibc": ({}, 0),
    "arena_max_2": ({"MALLOC_ARENA_MAX": "2"}, 0),
    "trim_threshold_128k": ({"MALLOC_TRIM_THRESHOLD_": "131072"}, 0),
    "mmap_threshold_64k": ({"MALLOC_MMAP_THRESHOLD_": "65536"}, 0),
    "malloc_trim": ({}, 1),
    "malloc_trim_every_8": ({}, 8),
    "jemalloc": ({"LD_PRELOAD": JEMALLOC}, 0),
}


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo() -> dict[str, float]:
    """glibc's heaps in MiB: ``heap`` (sbrk and arena heaps), ``in_use``, ``free``, ``mmapped``
    (blocks above the mmap threshold). All ~0 under jemalloc (glibc's malloc is unused)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return {"heap": info.arena / 2**20, "in_use": info.uordblks / 2**20,
            "free": info.fordblks / 2**20, "mmapped": info.hblkhd / 2**20}


def _rss_mib(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _live_objects() -> dict[str, int]:
    objects = gc.get_objects()
    return {"tensors": sum(1 for o in objects if isinstance(o, torch.Tensor)),
            "gc_objects": len(objects)}


def step_data(step: int, samples: int) -> StreamedStep:
    """Step ``step``'s micro-batches, as the rank's event loop feeds them, then closed."""
    batch = synthetic_samples(samples, vocab_size=len(VOCAB), min_tokens=MIN_TOKENS,
                              max_tokens=MAX_TOKENS, group_size=min(8, samples), turns=TURNS,
                              seed=step)
    by_id = {s.seq_id: s for s in batch}
    stream = StreamedStep()
    for mb in form_micro_batches([s.as_sequence() for s in batch], 1, TOKENS_PER_RANK):
        stream.add(mb, [by_id[r.seq_id] for r in mb.sequences])
    stream.close()
    return stream


def one(name: str, steps: int, samples: int) -> dict:
    """Variant ``name`` (its environment already set by the parent) in this process."""
    torch.set_num_threads(1)
    trace = name == "glibc"
    actor = ActorWorker(make_backend("ddp", init_model("tiny", seed=0).train(),
                                     dist.group.WORLD), CONFIG,
                        release_every=VARIANTS[name][1])
    ref = RefWorker(make_backend("ddp", init_model("tiny", seed=0), trainable=False))
    pool = ThreadPoolExecutor(1, "step")  # asyncio.to_thread's pool reuses an idle thread
    rss, seconds, cpu, faults, checkpoints, micro_batches = [], [], [], [], {}, []
    growth: list[str] = []
    for step in range(steps):
        stream = step_data(step, samples)
        micro_batches.append(len(stream.micro_batches))
        executor = ColocatedExecutor.for_step_mode(StepMode.COLOCATED, ref, actor, max_aggregate=8,
                                              group=dist.group.WORLD)
        start, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        pool.submit(executor.run_step, stream, stream, time.time()).result()
        seconds.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
        faults.append(after.ru_minflt - usage.ru_minflt)
        del stream, executor
        rss.append(round(_rss_mib(), 1))
        if step in CHECKPOINTS or step == steps - 1:
            checkpoints[step] = {"rss_mib": rss[-1], **_live_objects(),
                                 **{k: round(v, 1) for k, v in _mallinfo().items()}}
        if trace and step == TRACE_FROM:
            tracemalloc.start(8)
            first = tracemalloc.take_snapshot()
        if trace and step == steps - 1 and step > TRACE_FROM:
            last = tracemalloc.take_snapshot()
            stats = last.compare_to(first, "lineno")
            growth = [str(s) for s in stats[:10]]
            checkpoints[step]["tracemalloc_traced_mib"] = round(
                tracemalloc.get_traced_memory()[0] / 2**20, 2)
            checkpoints[step]["tracemalloc_own_mib"] = round(
                tracemalloc.get_tracemalloc_memory() / 2**20, 2)
            tracemalloc.stop()
    pool.shutdown()
    return {"variant": name, "env": VARIANTS[name][0], "release_every": VARIANTS[name][1],
            "rss_at": {s: rss[s] for s in CHECKPOINTS if s < steps},
            "rss_max_mib": max(rss), "peak_rss_mib": _rss_mib("VmHWM"),
            "step_s_median": round(statistics.median(seconds), 3),
            "step_cpu_s_median": round(statistics.median(cpu), 3),
            "step_minor_faults_median": statistics.median(faults),
            "checkpoints": checkpoints, "tracemalloc_growth": growth,
            "micro_batches_per_step": statistics.mean(micro_batches), "rss_mib": rss}


def run_one(name: str, steps: int, samples: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                                rank=0, world_size=1)
        try:
            return one(name, steps, samples)
        finally:
            dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=151)
    parser.add_argument("--samples", type=int, default=10, help="sequences per step")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("--append", action="store_true",
                        help="add this run to the result file's runs instead of replacing them")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.steps, args.samples)))
        return
    rows = []
    for name in args.variants:
        env, _ = VARIANTS[name]
        if "LD_PRELOAD" in env and not Path(env["LD_PRELOAD"]).exists():
            print(f"{name:20s} skipped: no {env['LD_PRELOAD']}", flush=True)
            continue
        out = subprocess.run([sys.executable, __file__, "--one", name, "--steps",
                              str(args.steps), "--samples", str(args.samples)],
                             env={**os.environ, **env}, capture_output=True, text=True,
                             check=True)
        row = json.loads(out.stdout.splitlines()[-1])
        rows.append(row)
        at = "  ".join(f"{s}:{v:7.1f}" for s, v in row["rss_at"].items())
        print(f"{name:20s} RSS MiB {at}  max {row['rss_max_mib']:.0f}  "
              f"step {row['step_s_median']:.2f} s, CPU {row['step_cpu_s_median']:.2f} s, "
              f"{row['step_minor_faults_median']:.0f} faults", flush=True)
    run = {"finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": args.steps,
           "samples_per_step": args.samples, "rows": rows, "machine": machine_info()}
    runs = []
    if args.append and Path(args.out).exists():
        runs = json.loads(Path(args.out).read_text())["runs"]
    write_result(args.out, {
        "what": "an actor rank's RSS (MiB) after each step over many steps, per allocator "
                "setting; glibc's heap account and live tensors at checkpoints; each run's "
                "variants side by side (compare within a run)",
        "sequence_tokens": [MIN_TOKENS, MAX_TOKENS], "tokens_per_rank": TOKENS_PER_RANK,
        "threads": 1, "runs": [*runs, run]})


if __name__ == "__main__":
    main()
