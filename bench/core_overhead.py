"""Overhead of the pure policy core: one CTB round, one RA2P mode choice, one ERS plan.

    python bench/core_overhead.py [--rounds 300] [--out bench/results/core_overhead.json]

CTB round (the runtime's steady state): 10,000 tasks in flight on 64 rollout ranks (6,400 active,
1,000 paused, 2,600 new, GRPO groups of 8; budgets 2% above the initial usage). Each round applies
64 turn reports (contexts grow), the first-turn reports of the previous round's admissions (which
probe their groups), 8 finishes and one new group of 8, then runs ``CTBPolicy.schedule`` and
applies its plan. Events are drawn before the clock starts; the rest of the round is timed with
the garbage collector on, as the coordinator would run it.
Target: <= 2 ms per round on the 2-core development machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from machine import machine_info

from tiderl.core.ctb import CTBConfig, CTBPolicy, TaskBook
from tiderl.core.ers import ERSConfig, ERSInput, ERSPolicy
from tiderl.core.job import BatchBounds
from tiderl.core.ra2p import RA2PConfig, choose_placement
from tiderl.core.readiness import readiness_signals
from tiderl.core.types import Admit, Group, Pause, Placement, Ra2pTimings, Role, Task

NUM_RANKS = 64
NUM_ACTIVE, NUM_PAUSED, NUM_NEW = 6_400, 1_000, 2_600
GROUP_SIZE = 8
ENVS = ("webshop", "alfworld")
TARGET_CTB_MS = 2.0


def summarize(samples_s: list[float]) -> dict[str, float]:
    ms = sorted(s * 1e3 for s in samples_s)
    return {
        "median": round(statistics.median(ms), 4),
        "p90": round(ms[int(0.9 * (len(ms) - 1))], 4),
        "max": round(ms[-1], 4),
        "mean": round(statistics.fmean(ms), 4),
    }


# --------------------------------------------------------------------------- CTB


class CTBWorkload:
    """A book in the steady state described in the module docstring, and the events of a round."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.config = CTBConfig()
        self.book: TaskBook = self.config.new_book()
        self.policy = CTBPolicy(self.config)
        self.num_groups = 0
        self.just_admitted: list[str] = []
        for rank in range(NUM_RANKS):
            self.book.add_rank(rank, 1 << 40)  # the real budgets are set once it is populated

    def new_group(self) -> list[str]:
        group_id = f"g{self.num_groups}"
        self.num_groups += 1
        env = ENVS[self.num_groups % len(ENVS)]
        specs = tuple(Task(f"{group_id}-{i}", group_id, env) for i in range(GROUP_SIZE))
        self.book.add_group(Group(group_id, specs))
        return [s.task_id for s in specs]

    def populate(self) -> None:
        total = NUM_ACTIVE + NUM_PAUSED + NUM_NEW
        task_ids = [t for _ in range(total // GROUP_SIZE) for t in self.new_group()]
        running = task_ids[: NUM_ACTIVE + NUM_PAUSED]
        for i, task_id in enumerate(running):
            self.book.apply([Admit(task_id, i % NUM_RANKS)])
            context = self.rng.randint(300, 3_000)
            self.book.report_turn(task_id, context + 64, context, self.rng.random() < 0.3)
        self.book.apply([Pause(t) for t in running[NUM_ACTIVE:]])
        for rank, record in self.book.ranks.items():  # ~2% headroom: rounds must make room
            self.book.set_budget(rank, int(record.usage * 1.02))
        counts = (self.book.num_active, self.book.num_paused, self.book.num_new)
        assert counts == (NUM_ACTIVE, NUM_PAUSED, NUM_NEW), counts

    def draw_events(self) -> tuple[list[tuple[str, int, int, bool]], list[str]]:
        """The round's events as the ranks would report them (drawn outside the timed part)."""
        active = [t for r in self.book.ranks.values() for t in r.active]
        touched = self.rng.sample(active, 64 + 8)
        reports = []
        for task_id in touched[:64]:
            task, growth = self.book.tasks[task_id], self.rng.randint(16, 160)
            reports.append((task_id, task.footprint + growth, task.context_len + growth,
                            self.rng.random() < 0.3))
        for task_id in self.just_admitted:  # first turns of the last round's admissions
            if task_id in self.book.tasks and task_id not in touched:
                context = self.rng.randint(300, 3_000)
                reports.append((task_id, context + 64, context, True))
        return reports, touched[64:]

    def round(self, reports: list[tuple[str, int, int, bool]], finished: list[str]) -> int:
        """One steady-state round: events in, one plan out and applied; returns its size."""
        book = self.book
        for task_id, footprint, context, is_running in reports:
            book.report_turn(task_id, footprint, context, is_running)
        for task_id in finished:
            book.finish_task(task_id)
        self.new_group()
        plan = self.policy.schedule(book)
        book.apply(plan)
        self.just_admitted = [d.task_id for d in plan if isinstance(d, Admit)]
        return len(plan)


def run_ctb(rounds: int, warmup: int = 20) -> dict:
    workload = CTBWorkload()
    t0 = time.perf_counter()
    workload.populate()
    build_s = time.perf_counter() - t0
    samples, decisions = [], []
    for i in range(warmup + rounds):
        reports, finished = workload.draw_events()
        t0 = time.perf_counter()
        num = workload.round(reports, finished)
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            samples.append(elapsed)
            decisions.append(num)
    book = workload.book
    return {
        "round_ms": summarize(samples),
        "decisions_per_round_mean": round(statistics.fmean(decisions), 2),
        "book_after": {"ranks": len(book.ranks), "active": book.num_active,
                       "paused": book.num_paused, "new": book.num_new},
        "build_10k_tasks_ms": round(build_s * 1e3, 1),
    }


# --------------------------------------------------------------------------- RA2P and ERS

TIMINGS = Ra2pTimings(t_ref=0.08, t_act_f=0.10, t_act_b=0.20, t_swap=0.5)


def ready_times(rng: random.Random, num: int, num_at_start: int) -> list[float]:
    later, clock = [], 0.0
    for _ in range(num - num_at_start):
        clock += rng.expovariate(1 / 0.4)
        later.append(clock)
    return [-rng.uniform(0.0, 5.0) for _ in range(num_at_start)] + later


def run_ra2p(reps: int) -> dict:
    rng, config = random.Random(1), RA2PConfig()
    cases = [ready_times(rng, 256, rng.randint(0, 256)) for _ in range(32)]
    samples, modes = [], []
    for i in range(reps):
        times = cases[i % len(cases)]
        t0 = time.perf_counter()
        mode = choose_placement(times, TIMINGS, max_aggregate=8, config=config)
        samples.append(time.perf_counter() - t0)
        modes.append(mode)
    return {"choose_mode_ms": summarize(samples),
            "decoupled_fraction": round(modes.count(Placement.DECOUPLED) / len(modes), 3)}


def run_ers(reps: int) -> dict:
    rng, policy = random.Random(2), ERSPolicy(ERSConfig(), RA2PConfig())
    roles = tuple([Role.ROLLOUT] * 48 + [Role.REF] * 2 + [Role.ACTOR] * 14)
    samples = []
    for i in range(reps):
        times = ready_times(rng, 64, rng.randint(0, 64))
        signals = readiness_signals(times, 0.0, now=30.0, samples_per_mb=8)
        inp = ERSInput(step=10 + i, is_eval_step=False, signals=signals, step_duration_s=30.0,
                       roles=roles, placement=Placement.DECOUPLED, timings=TIMINGS,
                       num_micro_batches=64,
                       batch=BatchBounds(min=32, ideal=64))
        t0 = time.perf_counter()
        policy.plan(inp)
        samples.append(time.perf_counter() - t0)
    return {"plan_ms": summarize(samples), "ranks": len(roles), "micro_batches": 64}


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300, help="timed CTB rounds")
    parser.add_argument("--reps", type=int, default=2000, help="timed RA2P / ERS calls")
    parser.add_argument("--repeats", type=int, default=3,
                        help="independent CTB runs (fresh book); the headline is their median")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                                "core_overhead.json"))
    args = parser.parse_args()
    ctb_runs = [run_ctb(args.rounds) for _ in range(args.repeats)]
    ra2p, ers = run_ra2p(args.reps), run_ers(args.reps)
    ctb_ms = statistics.median(run["round_ms"]["median"] for run in ctb_runs)
    result = {
        "ctb_round_ms_10k_tasks_64_ranks": ctb_ms,
        "ra2p_choose_mode_ms_256_mb": ra2p["choose_mode_ms"]["median"],
        "ers_plan_ms": ers["plan_ms"]["median"],
        "target": {"ctb_round_ms_10k_tasks_64_ranks": TARGET_CTB_MS},
        "meets_target": ctb_ms <= TARGET_CTB_MS,
        "details": {"ctb_runs": ctb_runs, "ra2p": ra2p, "ers": ers},
        "machine": machine_info(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write(json.dumps({k: result[k] for k in list(result)[:5]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
