"""ERS's two planners side by side in the simulator: the rules (``ers.planner: rules``) and the
predictive planner (``predictive``), against the fixed splits of the asynchronous system.

    python bench/ers_planner.py [--profiles sim/fig8-paper,sim/shifting,sim/cluster32]
                                [--out bench/results/ers_planner.json]

Per profile: the goodput of TideRL with each planner and of ``async`` at each fixed rollout share
(the best of them is "best fixed"), the ratios, and each planner's moves: plans by reason, the
ranks moved, the layouts visited. The runs of one profile share its seed, so they roll out the
same task stream; two processes run them side by side.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path

from machine import machine_info, write_result

from tiderl.profile import load_profile
from tiderl.profile.scenario import scenario_of
from tiderl.sim.cluster import simulate
from tiderl.sim.scenario import SYSTEMS

FIXED_SHARES = (0.125, 0.25, 0.375, 0.5, 0.625)
PLANNERS = ("rules", "predictive")


def run_one(profile: str, system: str, overrides: tuple[str, ...]) -> dict[str, object]:
    t0 = time.perf_counter()
    result = simulate(SYSTEMS[system], scenario_of(load_profile(profile,
                                                                          list(overrides))))
    row: dict[str, object] = {"goodput_tok_s": round(result.goodput_tok_s, 1),
                              "wall_s": round(result.wall_s, 1),
                              "discarded_tokens": result.discarded_tokens,
                              "run_s": round(time.perf_counter() - t0, 1)}
    if system == "tiderl":
        steps = result.steps
        row["reasons"] = dict(Counter(s.ers_reason for s in steps))
        row["rollout_ranks"] = [s.roles.count("rollout") for s in steps]
        row["ranks_moved"] = sum(abs(a.roles.count("rollout") - b.roles.count("rollout"))
                                 for a, b in pairwise(steps))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", default="sim/fig8-paper,sim/shifting,sim/cluster32")
    parser.add_argument("--out",
                        default=str(Path(__file__).parent / "results" / "ers_planner.json"))
    args = parser.parse_args()
    t0 = time.perf_counter()
    jobs = []
    for profile in args.profiles.split(","):
        jobs += [(profile, f"tiderl {p}", "tiderl", (f"ers.planner={p}",)) for p in PLANNERS]
        jobs += [(profile, f"async {share}", "async", (f"sim.rollout_ratio={share}",))
                 for share in FIXED_SHARES]
    with ProcessPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(run_one, profile, system, overrides)
                   for profile, _, system, overrides in jobs]
        rows = [f.result() for f in futures]
    profiles: dict[str, dict[str, object]] = {}
    for (profile, label, _, _), row in zip(jobs, rows, strict=True):
        profiles.setdefault(profile, {"runs": {}})["runs"][label] = row
    for profile, entry in profiles.items():
        runs = entry["runs"]
        fixed = {label: r["goodput_tok_s"] for label, r in runs.items()
                 if label.startswith("async")}
        best = max(fixed, key=fixed.get)
        entry["best_fixed"] = best
        for planner in PLANNERS:
            entry[f"{planner}_over_best_fixed"] = round(
                runs[f"tiderl {planner}"]["goodput_tok_s"] / fixed[best], 3)
        entry["predictive_over_rules"] = round(runs["tiderl predictive"]["goodput_tok_s"]
                                               / runs["tiderl rules"]["goodput_tok_s"], 3)
        print(f"{profile}: rules {entry['rules_over_best_fixed']}x, predictive "
              f"{entry['predictive_over_best_fixed']}x the best fixed ({best}); predictive / rules "
              f"{entry['predictive_over_rules']}x", flush=True)
    write_result(args.out, {
        "experiment": "ers_planner", "profiles": profiles, "fixed_shares": list(FIXED_SHARES),
        "wall_s": round(time.perf_counter() - t0, 1), "machine": machine_info(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
