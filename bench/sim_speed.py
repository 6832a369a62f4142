"""Speed of the simulator: 100 steps on 32 simulated GPUs, WebShop + ALFWorld, all four systems.

    python bench/sim_speed.py [--steps 100] [--gpus 32] [--out bench/results/sim_speed.json]

Target: all four systems together in <= 30 s of wall time on the 2-core development machine.
Measured both ways, side by side: one after the other in this process (the sum of the four), and
as ``tiderl sim`` runs them, in worker processes, one per CPU (``--jobs``; the wall time a user
waits, the four results checked equal to the first way's).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from machine import machine_info, write_result

from tiderl.profile import load_profile
from tiderl.profile.scenario import scenario_of
from tiderl.sim.cluster import simulate
from tiderl.sim.progress import run_all, usable_cpus, workers
from tiderl.sim.scenario import SYSTEMS

TARGET_S = 30.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=32)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sim_speed.json"))
    args = parser.parse_args()
    profile = load_profile("sim/cluster32", [f"job.steps={args.steps}", f"sim.gpus={args.gpus}"])
    scenario = scenario_of(profile)
    names = ("sync", "async", "stream", "tiderl")
    per_system, serial = {}, {}
    for name in names:
        t0 = time.perf_counter()
        result = serial[name] = simulate(SYSTEMS[name], scenario)
        elapsed = time.perf_counter() - t0
        per_system[name] = {"wall_s": round(elapsed, 2), "simulated_s": round(result.wall_s, 1),
                            "steps": len(result.steps),
                            "goodput_tok_s": round(result.goodput_tok_s, 1)}
    total = sum(p["wall_s"] for p in per_system.values())
    cpus = usable_cpus()
    t0 = time.perf_counter()
    with workers(cpus):
        parallel = run_all({n: functools.partial(simulate, SYSTEMS[n], scenario) for n in names})
    parallel_s = time.perf_counter() - t0
    same = all(parallel[n].steps == serial[n].steps and
               parallel[n].goodput_tok_s == serial[n].goodput_tok_s for n in names)
    out = {
        "total_wall_s": round(total, 2),
        "parallel_wall_s": round(parallel_s, 2),
        "parallel_workers": cpus,
        "parallel_results_equal": same,
        "target_s": TARGET_S,
        "meets_target": parallel_s <= TARGET_S,
        "meets_target_one_process": total <= TARGET_S,
        "scenario": {"workload": scenario.sim.workload, "model": scenario.sim.model,
                     "gpus": scenario.sim.gpus, "steps": scenario.job.steps},
        "per_system": per_system,
        "machine": machine_info(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
