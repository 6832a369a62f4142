"""TideRL, stream and async in turns: ``bench e2e``'s text workload, several rounds, the ratio of
medians (the machine's noise between rounds is larger than the differences measured).

    python bench/e2e_pairs.py [--rounds 5] [--steps 10] [--out bench/results/e2e_pairs.json]

Each round runs tiderl and stream at ``bench/e2e.py``'s fixed split (2 of 4 ranks rolling out)
and async at the same split (the best split in ``results/e2e.json``), one after the other, as
real jobs on this machine (``tiderl.launch.job.run_local``). Issue 41's target: tiderl >= stream
and >= async at its best split (ratio of medians >= 1.0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from e2e import FIXED_SPLIT, WORKLOAD
from jobs import run_job
from machine import machine_info, write_result

MODES = (("tiderl", ["runtime.system=tiderl"]), ("stream", ["runtime.system=stream"]),
         ("async", ["runtime.system=async"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out",
                        default=str(Path(__file__).parent / "results" / "e2e_pairs.json"))
    args = parser.parse_args()
    goodput: dict[str, list[float]] = {name: [] for name, _ in MODES}
    root = Path(tempfile.mkdtemp(prefix="tiderl-e2e-pairs-"))
    for n in range(args.rounds):
        for name, overrides in MODES:
            job = run_job(f"{name}-{n}", [*WORKLOAD, *overrides,
                                         f"runtime.rollout_ranks={FIXED_SPLIT}"],
                          args.steps, root, lambda line: print(line, file=sys.stderr))
            goodput[name].append(job.summary["goodput_end_tok_s"])
    median = {name: statistics.median(values) for name, values in goodput.items()}
    out = {"steps": args.steps, "rounds": args.rounds, "split": f"{FIXED_SPLIT} of 4 ranks",
           "workload": WORKLOAD, "goodput_tok_s": goodput, "median_tok_s": median,
           "tiderl_over_stream": round(median["tiderl"] / median["stream"], 3),
           "tiderl_over_async": round(median["tiderl"] / median["async"], 3),
           "target": 1.0, "machine": machine_info(),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
