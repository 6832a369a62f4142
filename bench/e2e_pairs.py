"""TideRL, stream and async in turns: ``bench e2e``'s text workload, several rounds, the ratio of
medians (the machine's noise between rounds is larger than the differences measured).

    python bench/e2e_pairs.py [--rounds 5] [--steps 10] [--out bench/results/e2e_pairs.json]
    python bench/e2e_pairs.py --median-s 0.5 --async-splits 1,2,3 \
        --out bench/results/e2e_pairs_lognormal05.json

Each round runs tiderl and stream at ``bench/e2e.py``'s fixed split (2 of 4 ranks rolling out)
and async at the same split (the best split in ``results/e2e.json``), one after the other, as
real jobs on this machine (``tiderl.launch.job.run_local``). Issue 41's target: tiderl >= stream
and >= async at its best split (ratio of medians >= 1.0).

``--median-s``: the environment's lognormal step latency median in place of the workload's
(sigma stays 1.0); ``--async-splits``: async at each of these rollout-rank counts, every round,
and tiderl over the best of their medians (target with median 0.5 s: >= 1.15).
``--variant NAME=OVERRIDE[,OVERRIDE]`` (repeatable): tiderl once more each round with these
profile overrides (an A/B in turns), reported over tiderl, stream and the best async; a list
value keeps its commas (``env.envs=[guess,shop]``).

Each job's first step's end and its mean step after it are recorded too (``first_step_end_s``,
``later_step_s``, and their medians): a 10-step job's goodput counts its cold start; and the
boundaries at which a rank changed role (``role_moves``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from e2e import FIXED_SPLIT, WORKLOAD
from jobs import parse_variants, run_job
from machine import machine_info, write_result


def modes(async_splits: list[int], variants: dict[str, list[str]] | None = None
          ) -> list[tuple[str, list[str]]]:
    """(name, overrides) of each job a round runs; async once per split (named by its rollout
    ranks where there are several); each variant is tiderl with its overrides."""
    tiderl = ["runtime.system=tiderl", f"runtime.rollout_ranks={FIXED_SPLIT}"]
    out = [("tiderl", tiderl),
           ("stream", ["runtime.system=stream", f"runtime.rollout_ranks={FIXED_SPLIT}"])]
    out += [(name, [*tiderl, *extra]) for name, extra in (variants or {}).items()]
    for n in async_splits:
        name = "async" if async_splits == [FIXED_SPLIT] else f"async r{n}"
        out.append((name, ["runtime.system=async", f"runtime.rollout_ranks={n}"]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out",
                        default=str(Path(__file__).parent / "results" / "e2e_pairs.json"))
    parser.add_argument("--median-s", type=float, default=None)
    parser.add_argument("--async-splits", default=str(FIXED_SPLIT))
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME=OVERRIDE[,OVERRIDE]: tiderl with these overrides too")
    args = parser.parse_args()
    try:
        variants = parse_variants(args.variant, lambda name: name in ("tiderl", "stream")
                                  or name.startswith("async"))
    except ValueError as error:
        parser.error(str(error))
    workload = list(WORKLOAD)
    if args.median_s is not None:
        workload.append(f"env.step_latency.median_s={args.median_s}")
    runs = modes([int(n) for n in args.async_splits.split(",")], variants)
    goodput: dict[str, list[float]] = {name: [] for name, _ in runs}
    # where the time goes: the first step's end (a cold start: admission before any task
    # finished) and the mean step after it
    first: dict[str, list[float]] = {name: [] for name, _ in runs}
    later: dict[str, list[float]] = {name: [] for name, _ in runs}
    # role moves: boundaries where a rank changed role (ERS's trials and reverts on shared cores)
    moves: dict[str, list[int]] = {name: [] for name, _ in runs}
    root = Path(tempfile.mkdtemp(prefix="tiderl-e2e-pairs-"))
    for n in range(args.rounds):
        for name, overrides in runs:
            job = run_job(f"{name.replace(' ', '-')}-{n}", [*workload, *overrides], args.steps,
                          root, lambda line: print(line, file=sys.stderr))
            goodput[name].append(job.summary["goodput_end_tok_s"])
            head, tail = job.metrics[0], job.metrics[-1]
            first[name].append(round(head.end_s, 2))
            later[name].append(round((tail.end_s - head.end_s) / max(1, len(job.metrics) - 1),
                                     3))
            moves[name].append(sum(a.roles != b.roles for a, b in pairwise(job.metrics)))
    median = {name: statistics.median(values) for name, values in goodput.items()}
    best = max((name for name in median if name.startswith("async")), key=median.__getitem__)
    out = {"steps": args.steps, "rounds": args.rounds, "split": f"{FIXED_SPLIT} of 4 ranks",
           "workload": workload, "goodput_tok_s": goodput, "median_tok_s": median,
           "first_step_end_s": first, "later_step_s": later,
           "median_first_step_end_s": {n: statistics.median(v) for n, v in first.items()},
           "median_later_step_s": {n: statistics.median(v) for n, v in later.items()},
           "role_moves": moves,
           "tiderl_over_stream": round(median["tiderl"] / median["stream"], 3),
           "best_async": best, "tiderl_over_async": round(median["tiderl"] / median[best], 3),
           "target": 1.15 if args.median_s == 0.5 else 1.0,
           "variants": {name: {"overrides": extra,
                               "over_tiderl": round(median[name] / median["tiderl"], 3),
                               "over_stream": round(median[name] / median["stream"], 3),
                               "over_async": round(median[name] / median[best], 3)}
                        for name, extra in variants.items()},
           "machine": machine_info(),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
