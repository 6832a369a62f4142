"""Every rank's resident set over a long job in which a rollout rank dies and the other takes over
its tasks: flat, or growing?

A real job (``tiderl launch``, the default profile with 4 ranks, 2 of them rollout, a checkpoint
every 2 steps, ERS off so that the roles stay put, steps enough to outlast the run) runs for
``--minutes``. Once ``--kill-after`` steps are trained, one rollout rank gets ``kill -9`` (by
PID, from the job's ``job.json``): the coordinator hands its tasks to the surviving rollout
rank. Every ``--every`` seconds each live process of the job is sampled from ``/proc``: VmRSS,
its anonymous part (RssAnon) and its thread count. At the end the launcher gets SIGTERM (it
stops the job in order).

Recorded per process: the RSS series (seconds since launch, MiB), first / last / max, and the
slope in MiB per minute (least squares) over the last ``--slope-minutes`` minutes; the steps
trained, the kill's time and step.

Run: ``.venv/bin/python bench/memory_soak.py [--minutes 30] [--no-kill] [--set KEY=VALUE ...]``
(the job takes both cores of a 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the chaos tests' job helpers
from machine import machine_info, write_result

from tests.chaos.chaos_job import Launch, steps_done
from tests.integration.running_job import stop_job
from tests.integration.serving import tiderl_command
from tiderl.launch.local import JobRecord, is_running

RESULT = Path(__file__).parent / "results" / "memory_soak.json"
JOB = ["runtime.num_ranks=4", "runtime.rollout_ranks=2", "runtime.checkpoint_every=2",
       "ers.enabled=false", "report.plots=false", "job.steps=100000"]
FIELDS = ("VmRSS", "RssAnon", "Threads")


def read_status(pid: int) -> dict[str, float] | None:
    """VmRSS and RssAnon in MiB and the thread count of ``pid``; None once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return None
    found = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in FIELDS:
            number = int(value.split()[0])
            found[key] = number if key == "Threads" else round(number / 1024, 1)
    return found if "VmRSS" in found else None  # a zombie has no VmRSS


def slope_mib_per_min(series: list[tuple[float, float]], window_s: float) -> float | None:
    """Least-squares slope of the samples in the last ``window_s`` seconds, MiB per minute;
    None with fewer than 3."""
    if not series:
        return None
    end = series[-1][0]
    points = [(t, v) for t, v in series if t >= end - window_s]
    if len(points) < 3:
        return None
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return round(60 * cov / var, 2) if var else None


def roles(run_dir: Path, state: JobRecord) -> dict[str, str]:
    """Each rank process's role at launch (its log's "rank N up: ROLE")."""
    found = {}
    for record in state.processes:
        if record.kind == "rank":
            text = (run_dir / "logs" / f"{record.name}.log").read_text(errors="replace")
            found[record.name] = text.split(f"rank {record.rank} up: ", 1)[1].split()[0]
    return found


def sample(state: JobRecord, series: dict[str, list[dict]], now: float) -> None:
    """One sample of every live process of the job into ``series``."""
    for record in state.processes:
        status = read_status(record.pid)
        if status is not None:
            series[record.name].append({"t_s": now, **status})


def kill_rollout_rank(run_dir: Path, state: JobRecord) -> str:
    """kill -9 of the last rank that started in rollout; its name."""
    victim = [name for name, role in roles(run_dir, state).items() if role == "rollout"][-1]
    os.kill(next(p.pid for p in state.processes if p.name == victim), signal.SIGKILL)
    return victim


def soak(run_root: Path, minutes: float, every_s: float, kill_after: int | None,
         overrides: list[str], slope_minutes: float) -> dict:
    """Run the job for ``minutes``, sampling every ``every_s`` seconds and killing a rollout
    rank once ``kill_after`` steps are trained (None: never); the result's fields."""
    run_root.mkdir(parents=True, exist_ok=True)
    log = run_root / "launcher.log"
    argv = [*tiderl_command(), "launch", "--run-root", str(run_root)]
    for item in (*JOB, *overrides):
        argv += ["--set", item]
    start = time.monotonic()
    with log.open("w") as out:
        launcher = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    state, killed = None, None
    try:
        state = Launch(run_root, launcher, log).state()
        run_dir = Path(state.run_dir)
        series: dict[str, list[dict]] = {p.name: [] for p in state.processes}
        while (now := round(time.monotonic() - start, 1)) < minutes * 60:
            if launcher.poll() is not None:
                raise SystemExit(f"the job ended early:\n{log.read_text()[-3000:]}")
            sample(state, series, now)
            step = steps_done(run_dir)
            if killed is None and kill_after is not None and step >= kill_after:
                killed = {"rank": kill_rollout_rank(run_dir, state), "t_s": now, "step": step}
            print(f"{now:7.1f} s step {step}: " + "  ".join(
                f"{name} {points[-1]['VmRSS']:.0f}" for name, points in series.items()
                if points and points[-1]["t_s"] == now), flush=True)
            time.sleep(every_s)
        steps, launched_as = steps_done(run_dir), roles(run_dir, state)
    finally:
        stop_job(launcher, state, grace_s=120)
    return {"steps": steps, "killed": killed,
            "left_running": [p.name for p in state.processes if is_running(p.pid)],
            "processes": {name: {"role": launched_as.get(name, name),
                                 **summary(points, slope_minutes * 60)}
                          for name, points in series.items() if points}}


def summary(points: list[dict], window_s: float) -> dict:
    rss = [(p["t_s"], p["VmRSS"]) for p in points]
    values = [v for _, v in rss]
    return {"first_mib": values[0], "last_mib": values[-1], "max_mib": max(values),
            "slope_mib_per_min": slope_mib_per_min(rss, window_s),
            "alive_until_s": points[-1]["t_s"], "samples": points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--kill-after", type=int, default=2,
                        help="steps trained before a rollout rank is killed")
    parser.add_argument("--no-kill", action="store_true", help="kill no rank (the baseline)")
    parser.add_argument("--slope-minutes", type=float, default=20.0)
    parser.add_argument("--set", action="append", default=[], dest="overrides",
                        metavar="KEY=VALUE", help="another profile override for the job")
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("--run-root", help="where the job's run folder goes (default: a "
                        "temporary folder, removed after)")
    args = parser.parse_args()
    kill_after = None if args.no_kill else args.kill_after
    with tempfile.TemporaryDirectory() as tmp:
        run_root = Path(args.run_root or tmp)
        result = soak(run_root, args.minutes, args.every, kill_after, args.overrides,
                      args.slope_minutes)
    write_result(args.out, {"machine": machine_info(), "date": time.strftime("%Y-%m-%d"),
                            "minutes": args.minutes, "every_s": args.every,
                            "job": [*JOB, *args.overrides], **result})


if __name__ == "__main__":
    main()
