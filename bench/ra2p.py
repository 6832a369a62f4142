"""RA2P on four local CPU rank processes: measured step times vs the App. A cost models (paper
Fig. 14 analog), and a (RAS, TPRM) grid of measured fastest mode vs the mode the cost model picks.

Layouts: decoupled (DM) = rank 0 Ref, ranks 1-3 Actor (DDP over 3); colocated (CM, aggregating up
to ``max_aggregate`` ready micro-batches), VSO (a swap per model change) and VS (no swap) = Ref and
Actor on all four ranks (DDP over 4). On the CPU a swap moves nothing (both models already live in
host memory), so it is recorded as a no-op and measured as what it costs: almost nothing.

1. Profile, with every rank busy as in the steady state of each layout: t_ref, t_act_f, t_act_b
   per rank-share of a micro-batch, and t_swap.
2. Modes: N micro-batches of T tokens, all ready at the step start, in each mode; the measured
   step time (step start to the last backward, slowest rank; median of repeats) beside the cost
   model's prediction.
3. Grid: N micro-batches, RAS of them ready at the start and the rest every TPRM seconds; CM and
   DM measured in each cell; the fastest beside ``choose_placement``'s pick.

Run: ``.venv/bin/python bench/ra2p.py [--quick]`` or ``tiderl bench ra2p`` (about 4 minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info, write_result

from tiderl.core.ra2p import (
    RA2PConfig,
    choose_placement,
    cost_colocated,
    cost_decoupled,
    synthetic_ready_times,
)
from tiderl.core.types import MicroBatch, Ra2pTimings
from tiderl.models.random_init import init_model
from tiderl.trainer.batch import pack
from tiderl.trainer.config import TrainerConfig
from tiderl.trainer.executors import (
    ColocatedExecutor,
    DecoupledExecutor,
    ModelSwap,
    ScheduledArrivals,
    StepInput,
)
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.sample import TrainSample
from tiderl.trainer.spawn import RankContext, run_ranks
from tiderl.trainer.synthetic import synthetic_samples
from tiderl.trainer.timeline import Timeline
from tiderl.trainer.worker import ActorWorker, RefWorker

WORLD = 4
REF_RANKS, ACTOR_RANKS = [0], [1, 2, 3]
MODES = ("CM", "DM", "VS", "VSO")


@dataclass(frozen=True)
class BenchConfig:
    num_micro_batches: int = 8
    seqs_per_micro_batch: int = 12  # divisible by 3 and 4: equal shares in both layouts
    seq_tokens: int = 256
    max_aggregate: int = 8
    profile_iters: int = 5
    mode_repeats: int = 3
    grid_ras: tuple[int, ...] = (0, 2, 4, 8)
    grid_tprm_s: tuple[float, ...] = (0.1, 0.3, 0.6, 1.0)
    grid_repeats: int = 1
    model_size: str = "tiny"


# a check that it runs (tests/integration/test_trainer_dist.py), not a measurement
QUICK = BenchConfig(num_micro_batches=2, seq_tokens=32, profile_iters=2, mode_repeats=1,
                    grid_ras=(0, 2), grid_tprm_s=(0.1,))


def _step(config: BenchConfig, vocab_size: int) -> StepInput:
    """The step's micro-batches (all ready at 0; ``_with_ready_times`` sets a schedule)."""
    count = config.num_micro_batches * config.seqs_per_micro_batch
    samples = synthetic_samples(count, vocab_size=vocab_size, min_tokens=config.seq_tokens,
                                max_tokens=config.seq_tokens, seed=11)
    per = config.seqs_per_micro_batch
    mbs = tuple(MicroBatch(j, tuple(s.as_sequence() for s in samples[j * per:(j + 1) * per]))
                for j in range(config.num_micro_batches))
    return StepInput(mbs, {s.seq_id: s for s in samples})


def _with_ready_times(step: StepInput, ready_times: list[float]) -> StepInput:
    mbs = tuple(replace(mb, ready_time=t)
                for mb, t in zip(step.micro_batches, ready_times, strict=True))
    return StepInput(mbs, step.samples)


class Ranks:
    """The models and executors of one rank, for every layout."""

    def __init__(self, ctx: RankContext, config: BenchConfig):
        self.ctx, self.config = ctx, config
        ref_model = init_model(config.model_size, seed=1)
        self.step = _step(config, ref_model.config.vocab_size)
        trainer = TrainerConfig(lr=1e-5, kl_beta=0.01)
        self.actor_group = dist.new_group(ACTOR_RANKS)
        self.ref = RefWorker(make_backend("ddp", ref_model, trainable=False))
        self.col_actor = ActorWorker(make_backend("ddp", init_model(config.model_size)), trainer)
        self.colocated = {
            "CM": ColocatedExecutor(self.ref, self.col_actor,
                                    max_aggregate=config.max_aggregate, swap=True),
            "VSO": ColocatedExecutor(self.ref, self.col_actor, max_aggregate=1, swap=True),
            "VS": ColocatedExecutor(self.ref, self.col_actor, max_aggregate=1, swap=False)}
        if ctx.rank in REF_RANKS:
            self.decoupled = DecoupledExecutor(ctx.rank, REF_RANKS, ACTOR_RANKS, ref=self.ref)
            self.dec_actor = None
        else:
            backend = make_backend("ddp", init_model(config.model_size), self.actor_group)
            self.dec_actor = ActorWorker(backend, trainer)
            self.decoupled = DecoupledExecutor(ctx.rank, REF_RANKS, ACTOR_RANKS,
                                               actor=self.dec_actor, actor_group=self.actor_group)

    def synced_origin(self, lead_s: float = 0.1) -> float:
        """One wall-clock step start for all ranks, slightly ahead so every rank is waiting."""
        origin = torch.tensor([time.time() + lead_s], dtype=torch.float64)
        dist.broadcast(origin, src=0)
        value = float(origin.item())
        time.sleep(max(0.0, value - time.time()))
        return value

    def run(self, mode: str, ready_times: list[float]) -> float:
        """One step in ``mode``; the slowest rank's step time (start to last backward)."""
        step = _with_ready_times(self.step, ready_times)
        executor = self.decoupled if mode == "DM" else self.colocated[mode]
        origin = self.synced_origin()
        result = executor.run_step(step, ScheduledArrivals(step.micro_batches, origin), origin)
        seconds = torch.tensor([result.seconds])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return float(seconds.item())

    # ---------------------------------------------------------------- profiling

    def _share(self, num_ranks: int) -> list[TrainSample]:
        step = self.step
        seqs = step.micro_batches[0].sequences[:self.config.seqs_per_micro_batch // num_ranks]
        return [step.samples[s.seq_id] for s in seqs]

    def profile(self) -> dict[str, Ra2pTimings]:
        iters = self.config.profile_iters
        dec = self._profile_decoupled(iters)
        col = self._profile_colocated(iters)
        return {"decoupled": dec, "colocated": col}

    def _gather(self, values: dict[str, float], owners: dict[str, list[int]]) -> dict[str, float]:
        """Each timing from the ranks that measure it (their mean)."""
        names = sorted(owners)
        local = torch.tensor([values.get(n, 0.0) for n in names], dtype=torch.float64)
        dist.all_reduce(local)
        return {n: float(v) / len(owners[n]) for n, v in zip(names, local.tolist(), strict=True)}

    def _profile_decoupled(self, iters: int) -> Ra2pTimings:
        batch = pack(self._share(len(ACTOR_RANKS)))
        values: dict[str, float] = {}
        self.synced_origin()
        if self.ctx.rank in REF_RANKS:  # the Ref computes one share per actor rank
            times = []
            for _ in range(iters * len(ACTOR_RANKS)):
                start = time.perf_counter()
                self.ref.ref_logprobs(batch)
                times.append(time.perf_counter() - start)
            values["t_ref"] = statistics.median(times)
        else:
            ref_logprobs = self.ref.ref_logprobs(batch)
            fwd, bwd = _time_actor(self.dec_actor, batch, ref_logprobs, iters)
            values["t_act_f"], values["t_act_b"] = fwd, bwd
        dist.barrier()
        got = self._gather(values, {"t_ref": REF_RANKS, "t_act_f": ACTOR_RANKS,
                                    "t_act_b": ACTOR_RANKS})
        return Ra2pTimings(t_ref=got["t_ref"], t_act_f=got["t_act_f"], t_act_b=got["t_act_b"],
                           t_swap=0.0)

    def _profile_colocated(self, iters: int) -> Ra2pTimings:
        batch = pack(self._share(WORLD))
        swap = ModelSwap({"ref": self.ref.backend.module,
                          "actor": self.col_actor.backend.module}, self.ctx.device)
        timeline = Timeline(self.ctx.rank)
        ref_times, swap_times, fwd_times, bwd_times = [], [], [], []
        self.synced_origin()
        for _ in range(iters):
            for target in ("ref", "actor"):
                start = time.perf_counter()
                swap.to(target, timeline)
                swap_times.append(time.perf_counter() - start)
                if target == "ref":
                    start = time.perf_counter()
                    ref_logprobs = self.ref.ref_logprobs(batch)
                    ref_times.append(time.perf_counter() - start)
                else:
                    fwd, bwd = _time_actor(self.col_actor, batch, ref_logprobs, 1)
                    fwd_times.append(fwd)
                    bwd_times.append(bwd)
        dist.barrier()
        med = {"t_ref": statistics.median(ref_times), "t_act_f": statistics.median(fwd_times),
               "t_act_b": statistics.median(bwd_times), "t_swap": statistics.median(swap_times)}
        everyone = list(range(WORLD))
        got = self._gather(med, dict.fromkeys(med, everyone))
        return Ra2pTimings(**got)


def _time_actor(actor: ActorWorker, batch, ref_logprobs, iters: int) -> tuple[float, float]:
    """Median forward and backward times of one share (no gradient reduction; zeroed after)."""
    fwd, bwd = [], []
    for _ in range(iters):
        start = time.perf_counter()
        pending = actor.forward(batch, sync=False)
        middle = time.perf_counter()
        actor.backward(pending, ref_logprobs)
        fwd.append(middle - start)
        bwd.append(time.perf_counter() - middle)
    actor.optimizer.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(bwd)


def predict(mode: str, times: list[float], timings: dict[str, Ra2pTimings],
            max_aggregate: int) -> float:
    """The App. A cost of ``mode``; VSO and VS are the aggregation loop with one micro-batch at
    a time, VS without swaps."""
    col = timings["colocated"]
    if mode == "DM":
        return cost_decoupled(times, timings["decoupled"])
    if mode == "CM":
        return cost_colocated(times, col, max_aggregate)
    if mode == "VSO":
        return cost_colocated(times, col, 1)
    return cost_colocated(times, replace(col, t_swap=0.0), 1)


def _bench_rank(ctx: RankContext, config: BenchConfig) -> dict | None:
    ranks = Ranks(ctx, config)
    ranks.run("CM", [0.0] * config.num_micro_batches)  # warm-up: allocator, thread pools
    ranks.run("DM", [0.0] * config.num_micro_batches)
    timings = ranks.profile()
    all_ready = [0.0] * config.num_micro_batches
    measured = {m: statistics.median(ranks.run(m, all_ready) for _ in range(config.mode_repeats))
                for m in MODES}
    cells = []
    for ras in config.grid_ras:
        for tprm in config.grid_tprm_s:
            times = synthetic_ready_times(config.num_micro_batches, ras, tprm)
            cell = {m: min(ranks.run(m, times) for _ in range(config.grid_repeats))
                    for m in ("CM", "DM")}
            cells.append((ras, tprm, times, cell))
    if ctx.rank != 0:
        return None
    return {"timings": {k: asdict(v) for k, v in timings.items()}, "measured": measured,
            "cells": cells}


def _placement_name(placement) -> str:
    return "DM" if placement.value == "decoupled" else "CM"


def run_bench(quick: bool = False, note: Callable[[str], None] = print) -> dict:
    config = QUICK if quick else BenchConfig()
    note(f"4 rank processes, {config.num_micro_batches} micro-batches of "
         f"{config.seqs_per_micro_batch}x{config.seq_tokens} tokens ...")
    started = time.perf_counter()
    raw = run_ranks(_bench_rank, WORLD, config, timeout_s=1800)[0]
    timings = {k: Ra2pTimings(**v) for k, v in raw["timings"].items()}
    ra2p = RA2PConfig(max_aggregate=config.max_aggregate)
    all_ready = [0.0] * config.num_micro_batches
    modes = {}
    for mode in MODES:
        predicted = predict(mode, all_ready, timings, config.max_aggregate)
        measured = raw["measured"][mode]
        modes[mode] = {"measured_s": round(measured, 4), "predicted_s": round(predicted, 4),
                       "error": round(abs(predicted - measured) / measured, 4)}
    chosen_all_ready = _placement_name(choose_placement(
        all_ready, timings["decoupled"], config.max_aggregate, ra2p,
        colocated_timings=timings["colocated"]))
    grid = []
    for ras, tprm, times, cell in raw["cells"]:
        chosen = _placement_name(choose_placement(times, timings["decoupled"],
                                                  config.max_aggregate, ra2p,
                                                  colocated_timings=timings["colocated"]))
        fastest = min(cell, key=cell.get)
        predicted = {m: predict(m, times, timings, config.max_aggregate) for m in cell}
        errors = {m: abs(predicted[m] - s) / s for m, s in cell.items()}
        grid.append({"ras": ras, "tprm_s": tprm, "fastest": fastest, "chosen": chosen,
                     "measured_s": {m: round(s, 4) for m, s in cell.items()},
                     "predicted_s": {m: round(p, 4) for m, p in predicted.items()},
                     "margin": round(abs(cell["CM"] - cell["DM"]) / min(cell.values()), 4),
                     "prediction_error_max": round(max(errors.values()), 4)})
    errors = [m["error"] for m in modes.values()] + [c["prediction_error_max"] for c in grid]
    result = {
        "config": asdict(config),
        "timings": {k: {f: round(v, 5) for f, v in asdict(t).items()}
                    for k, t in timings.items()},
        "modes": modes,
        "chosen_all_ready": chosen_all_ready,
        "grid": grid,
        "prediction_error_max": round(max(errors), 4),
        "prediction_error_max_modes": round(max(m["error"] for m in modes.values()), 4),
        "chosen_is_fastest_fraction": round(
            sum(c["chosen"] == c["fastest"] for c in grid) / len(grid), 4),
        "targets": {"prediction_error_max": 0.15, "chosen_is_fastest_fraction": 0.9},
        "seconds": round(time.perf_counter() - started, 1),
        "machine": machine_info(),
    }
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(result["modes"])
    xs = range(len(names))
    left.bar([x - 0.2 for x in xs], [result["modes"][n]["measured_s"] for n in names], 0.4,
             label="measured")
    left.bar([x + 0.2 for x in xs], [result["modes"][n]["predicted_s"] for n in names], 0.4,
             label="cost model")
    left.set_xticks(list(xs), names)
    left.set_ylabel("step time (s)")
    left.set_title("all micro-batches ready at the step start")
    left.legend()
    colours = {"CM": "tab:blue", "DM": "tab:orange"}
    for cell in result["grid"]:
        right.scatter(cell["tprm_s"], cell["ras"], s=260, c=colours[cell["fastest"]],
                      alpha=0.35)
        right.scatter(cell["tprm_s"], cell["ras"], s=50, c=colours[cell["chosen"]],
                      marker="x" if cell["chosen"] == cell["fastest"] else "D")
    right.set_xlabel("TPRM (s)")
    right.set_ylabel("RAS (micro-batches ready at start)")
    right.set_title("measured fastest (disc) vs chosen (mark); blue CM, orange DM")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="2 micro-batches of 12x32 tokens, a 2-cell grid, no repeats "
                             "(a check that it runs)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "ra2p.json")
    args = parser.parse_args()
    result = run_bench(args.quick, lambda line: print(line, file=sys.stderr))
    plot(result, args.out.with_suffix(".png"))
    write_result(args.out, result)


if __name__ == "__main__":
    main()
