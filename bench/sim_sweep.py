"""The simulator's calibration sweep: environment latency (median x sigma), staleness bound and
sync's colocate switch around the paper-like profile, every system on each point.

    python bench/sim_sweep.py [--profile sim/fig8-paper] [--out bench/results/sim_sweep.json]

Writes the rows and headline (``tiderl sim --sweep``'s) beside the machine facts, and the heat
map next to the JSON (``sim_sweep.png``). Each point is a 20-step run (the paper's runs are 100).
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from machine import machine_info, write_result

from tiderl.profile import load_profile
from tiderl.profile.scenario import scenario_of
from tiderl.sim.progress import usable_cpus, workers
from tiderl.sim.report import write_sweep_heatmap
from tiderl.sim.runner import run_scenario_sweep


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="sim/fig8-paper")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "sim_sweep.json"))
    args = parser.parse_args()
    t0 = time.perf_counter()
    with workers(usable_cpus()):  # as tiderl sim --sweep runs them
        payload = run_scenario_sweep(scenario_of(load_profile(args.profile, [])))
    plot = write_sweep_heatmap(payload.pop("result"), Path(args.out).with_suffix(".png"))
    payload.update({"profile": args.profile, "plot": plot.name,
                    "wall_s": round(time.perf_counter() - t0, 1), "machine": machine_info(),
                    "date": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    write_result(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
