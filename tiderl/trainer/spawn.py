"""Run a function on N local rank processes joined in one torch.distributed group.

Used by the trainer benchmark and the multi-process tests; the runtime's rank daemons join their
group the same way (``init_rank``) from an address the coordinator hands out. Each rank is a real
process of its own, so nothing is shared but the sockets: multiprocessing's ``forkserver``
forks it from a server process that has only imported ``PRELOAD`` (torch, and what DDP imports
on first use), once for all the groups this process runs. A ``spawn``-ed interpreter imported
all of it again for every rank: about 5 s of CPU each (2 of them DDP's first wrap, which
imports torch._dynamo: named in ``PRELOAD`` itself, since torch 2.13's
torch.distributed._functional_collectives no longer imports it).
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tiderl.ports import free_port

T = TypeVar("T")

PRELOAD = ("torch", "torch.distributed", "torch.distributed._functional_collectives",
           "torch._dynamo", "tiderl.trainer.parallel", "tiderl.trainer.spawn")


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    device: torch.device


class RankError(RuntimeError):
    """A rank process raised, died or did not finish in time; the message says which."""


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_rank(rank: int, world_size: int, init_method: str, *, device: str = "cpu",
              threads: int = 1, timeout_s: float = 300.0, backend: str = "",
              memory_fraction: float = 0.0) -> RankContext:
    """Join the process group of ``world_size`` ranks at ``init_method`` (``tcp://host:port``)
    over ``backend`` (empty: nccl on CUDA, else gloo). ``device``: ``cuda:i`` is that device
    (ranks may share one; then the launch asks for gloo: NCCL refuses two ranks of one
    communicator on one device), a bare ``cuda`` the rank's modulo the visible ones;
    ``memory_fraction`` > 0 caps this process's CUDA caching allocator at that share of it."""
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else rank % torch.cuda.device_count()
        dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
        if memory_fraction > 0:
            torch.cuda.set_per_process_memory_fraction(memory_fraction, dev)
    dist.init_process_group(backend or default_backend(dev), init_method=init_method,
                            rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return RankContext(rank=rank, world_size=world_size, device=dev)


def _child(rank: int, world_size: int, init_method: str, fn: Callable, arg: Any,
           device: str, threads: int, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # forked, it starts with the server's random state: seeded afresh, as a new interpreter is
    random.seed()
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    try:
        ctx = init_rank(rank, world_size, init_method, device=device, threads=threads)
        value = fn(ctx, arg)
        # plain pickle copies tensor data: torch's queue would share it through file
        # descriptors that die with this process
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # report any failure to the parent, then exit non-zero
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # the parent joins this process: skip the exit's last garbage collections over every
        # object torch made (about 1 s on 2 cores); the result is on the queue, which is
        # flushed at exit as before
        gc.freeze()


def _check_alive(procs: list, values: dict, deadline: float, timeout_s: float) -> None:
    for rank, proc in enumerate(procs):
        if rank not in values and proc.exitcode is not None:
            raise RankError(f"rank {rank} exited with code {proc.exitcode} before reporting")
    if time.monotonic() > deadline:
        missing = sorted(set(range(len(procs))) - set(values))
        raise RankError(f"ranks {missing} did not finish within {timeout_s:.0f} s")


def run_ranks(fn: Callable[[RankContext, Any], T], world_size: int, arg: Any = None, *,
              device: str = "cpu", threads: int = 1, timeout_s: float = 600.0) -> list[T]:
    """``fn(ctx, arg)`` on ``world_size`` rank processes; their return values by rank.

    ``fn`` must be a module-level function and its argument and result picklable. The first
    rank to fail (or a timeout) raises ``RankError`` with its traceback, and every rank process
    is terminated: nothing is left running.
    """
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))  # read when the server starts: the first call
    results = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [context.Process(target=_child, daemon=True,
                             args=(r, world_size, init_method, fn, arg, device, threads, results))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    values: dict[int, T] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(values) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                _check_alive(procs, values, deadline, timeout_s)
                continue
            if not ok:
                raise RankError(f"rank {rank} failed:\n{value}")
            values[rank] = pickle.loads(value)
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [values[r] for r in range(world_size)]
