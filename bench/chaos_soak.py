"""A chaos soak: jobs with a rank killed at a random moment every ~20 s, over several seeds; from
the files alone, every group is trained once, dropped and counted, or left over.

    python bench/chaos_soak.py [--seeds 10] [--steps 40] [--every-s 20]
                               [--out bench/results/chaos_soak.json]

Each seed launches a real job (``tiderl launch``) of the chaos tests' profile
(``tests/chaos/chaos_job.py``: 3 ranks here raised to 4, 2 of them rolling out, a checkpoint every
2 steps, system tiderl with ERS moving ranks) for ``--steps`` steps. Every ``every_s`` × a random
factor in [0.5, 1.5] (the seed's), it kills one live rank whose role is rollout or actor (the
last step's layout in metrics.jsonl), with SIGKILL. A job that goes on is left to; a job that
stops must stop where docs/runtime.md ("Faults and resume") says it does (the last actor that
held the model, no rank left to roll out, no process group for the ranks left, or a process
that died before the job was up): it is then resumed with ``tiderl launch --resume`` as its
last line says, at most ``MAX_RESUMES`` times; the kills go on once the resumed job is up. Any
other stop is an unexplained one.

Per seed: each kill (seconds into the run, rank, role, the step count then, and the seconds to
the next trained step), each stop and its reason, the group fates of the run folder's live
lineage (``tiderl.runtime.group_fates``: trained, dropped, left over, and the problems: a group
trained twice, trained and dropped, counts that disagree). The table sums them: zero problems and
zero unexplained stops is the claim.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the chaos tests' job helpers
from machine import machine_info, write_result

from tests.chaos.chaos_job import Launch, chaos, launch, steps_done
from tiderl.launch.local import JobRecord, LaunchError
from tiderl.runtime.group_fates import Fate, group_fates
from tiderl.runtime.lineage import read_lineage

MAX_RESUMES = 3
DOCUMENTED_STOPS = (
    "was the last actor that held the model",
    "no rollout rank is left and no trainer rank can move",
    "which have no process group",
    "exited with code",  # a process died before the job was up: the launch failed, try again
)
PROFILE = ("runtime.num_ranks=4", "runtime.rollout_ranks=2")


def last_roles(run_dir: Path) -> list[str]:
    metrics = run_dir / "metrics.jsonl"
    rows = metrics.read_text().splitlines() if metrics.exists() else []
    for line in reversed(rows):
        try:
            return json.loads(line)["roles"]
        except (ValueError, KeyError):
            continue  # a line a kill cut short
    return []


def live_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of the ranks the job's record lists, those still running."""
    try:
        record = JobRecord.load(run_dir)
    except LaunchError:
        return {}
    out = {}
    for proc in record.processes:
        if proc.name.startswith("rank") and proc.name[4:].isdigit():
            try:
                os.kill(proc.pid, 0)
            except ProcessLookupError:
                continue
            out[int(proc.name[4:])] = proc.pid
    return out


def up_again(run_dir: Path, resumes: int) -> bool:
    """The resumed job is up: its coordinator wrote its ``resume`` event (every rank said
    Hello), so a kill now is a fault of a running job, not of its start."""
    events = run_dir / "events.jsonl"
    text = events.read_text() if events.exists() else ""
    return text.count('"kind": "resume"') >= resumes


def stop_line(job: Launch) -> str:
    lines = [x for x in job.output.splitlines() if x.startswith("error:")]
    return lines[-1] if lines else ""


def soak_one(seed: int, steps: int, every_s: float, root: Path) -> dict:
    rng = random.Random(seed)
    run_root = root / f"seed{seed}"
    kills, stops = [], []
    started = time.monotonic()
    with chaos(run_root) as jobs:
        job = launch(run_root, *PROFILE, steps=steps)
        jobs.append(job)
        state = job.state()
        run_dir = Path(state.run_dir)
        resumes = 0
        next_kill = time.monotonic() + every_s * rng.uniform(0.5, 1.5)
        while True:
            code = job.proc.poll()
            now = time.monotonic()
            for kill in kills:  # the seconds from each kill to the next trained step
                if kill["to_next_step_s"] is None and steps_done(run_dir) > kill["steps"]:
                    kill["to_next_step_s"] = round(now - started - kill["at_s"], 1)
            if code is not None:
                if code == 0:
                    break
                line = stop_line(job)
                documented = any(reason in line for reason in DOCUMENTED_STOPS)
                stops.append({"at_s": round(now - started, 1), "reason": line,
                              "documented": documented})
                if not documented or resumes == MAX_RESUMES:
                    break
                resumes += 1
                job = launch(run_root, resume=run_dir.name)
                jobs.append(job)
                job.until(lambda n=resumes: up_again(run_dir, n), "the resumed job up")
                next_kill = time.monotonic() + every_s * rng.uniform(0.5, 1.5)
                continue
            if now >= next_kill:
                roles, pids = last_roles(run_dir), live_pids(run_dir)
                victims = sorted(r for r, pid in pids.items()
                                 if r < len(roles) and roles[r] in ("rollout", "actor"))
                if victims:
                    rank = rng.choice(victims)
                    os.kill(pids[rank], signal.SIGKILL)
                    kills.append({"at_s": round(now - started, 1), "rank": rank,
                                  "role": roles[rank], "steps": steps_done(run_dir),
                                  "to_next_step_s": None})
                next_kill = now + every_s * rng.uniform(0.5, 1.5)
            time.sleep(0.2)
        fates = group_fates(run_dir)
        finished = job.proc.returncode == 0
    return {"seed": seed, "finished": finished, "seconds": round(time.monotonic() - started, 1),
            "steps": len(read_lineage(run_dir).metrics), "resumes": resumes, "kills": kills,
            "stops": stops,
            "groups": {fate.value: len(fates.of(fate)) for fate in Fate},
            "problems": fates.problems()}


def run_bench(seeds: int, steps: int, every_s: float) -> dict:
    runs = []
    with tempfile.TemporaryDirectory(prefix="tiderl-soak-") as tmp:
        for seed in range(seeds):
            run = soak_one(seed, steps, every_s, Path(tmp))
            runs.append(run)
            print(f"seed {seed}: finished={run['finished']} kills={len(run['kills'])} "
                  f"resumes={run['resumes']} groups={run['groups']} "
                  f"problems={len(run['problems'])}", flush=True)
    to_next = [k["to_next_step_s"] for r in runs for k in r["kills"]
               if k["to_next_step_s"] is not None]
    summary = {
        "runs": len(runs), "finished": sum(r["finished"] for r in runs),
        "kills": sum(len(r["kills"]) for r in runs),
        "kills_by_role": {role: sum(k["role"] == role for r in runs for k in r["kills"])
                          for role in ("rollout", "actor")},
        "resumes": sum(r["resumes"] for r in runs),
        "documented_stops": sum(s["documented"] for r in runs for s in r["stops"]),
        "unexplained_stops": sum(not s["documented"] for r in runs for s in r["stops"]),
        "problems": sum(len(r["problems"]) for r in runs),
        "groups": {fate.value: sum(r["groups"][fate.value] for r in runs) for fate in Fate},
        "kill_to_next_step_s": {"median": sorted(to_next)[len(to_next) // 2] if to_next
                                else None, "max": max(to_next, default=None)},
    }
    return {"benchmark": "chaos_soak", "steps": steps, "every_s": every_s,
            "profile": list(PROFILE), "summary": summary, "runs": runs,
            "machine": machine_info(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every-s", type=float, default=20.0)
    parser.add_argument("--out",
                        default=str(Path(__file__).parent / "results" / "chaos_soak.json"))
    args = parser.parse_args()
    write_result(args.out, run_bench(args.seeds, args.steps, args.every_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
