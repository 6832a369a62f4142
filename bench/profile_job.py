"""Where a real job's CPU goes, per process: py-spy over ``tiderl launch``'s whole process tree
on the one-token guess game (``job_vs_bare.py --game one-token``: 32 one-token episodes a step,
zero environment latency, no checkpoints), summarised.

    .venv/bin/python bench/profile_job.py [--steps 20] [--rate 100] [--out PATH]

Needs ``py-spy`` (``pip install py-spy``) and ptrace permission. The job runs in a child
interpreter under ``py-spy record --subprocesses --format raw``; each sample is put to its
process (launcher, coordinator, env service, rank r) and split into start-up (a stack inside an
import or ``RankDaemon.setup``) and the rest. Reported per process: CPU seconds (samples / rate;
py-spy counts threads it sees running, so a thread blocked in a C call such as ``accept`` can be
counted), and the functions with the largest inclusive share of its other samples, the frames
that say where a sample ran rather than what it did (threads, the event loop, entry points)
left out. The job's episodes/s and
step times come from its own records.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info, write_result

START_UP = ("_find_and_load", "RankDaemon.setup")
TOP = 20
# frames that say where a sample ran, not what it did (threads, the event loop, entry points)
GENERIC = re.compile(r"^(Thread\.|_worker$|_WorkItem\.run$|main$|<module>$|_run_code$|"
                     r"_run_module_as_main$|run$|Runner\.run$|BaseEventLoop\.|asyncio_run$|"
                     r"Handle\._run$|Module\._(wrapped_)?call_impl$|context_decorator\.|"
                     r"_rank$|_coordinator$|serve$|Context\.run$)")


def process_name(frame: str) -> str:
    rank = re.search(r"--rank (\d+)", frame)
    if rank:
        return f"rank{rank.group(1)}"
    for kind in ("coordinator", "env"):
        if f"tiderl.runtime {kind} " in frame:
            return kind
    return "launcher"


def summarise(raw: Path, rate: int) -> dict:
    steady: Counter[str] = Counter()
    start_up: Counter[str] = Counter()
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        at = max(i for i, f in enumerate(frames) if f.startswith("process "))
        name, n = process_name(frames[at]), int(count)
        if any(marker in stack for marker in START_UP):
            start_up[name] += n
            continue
        steady[name] += n
        for function in {f.split(" (")[0] for f in frames[at + 1:]}:
            inclusive[name][function] += n
    out = {}
    for name in sorted(steady | start_up):
        total = steady[name]
        shared = {f for f, n in inclusive[name].items() if n == total or GENERIC.match(f)}
        out[name] = {
            "cpu_s": round(total / rate, 2), "start_up_cpu_s": round(start_up[name] / rate, 2),
            "top": {f: round(n / total, 3) for f, n in inclusive[name].most_common()
                    if f not in shared}
            if total else {}}
        out[name]["top"] = dict(list(out[name]["top"].items())[:TOP])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rate", type=int, default=100)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "profile_job.json"))
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    with tempfile.TemporaryDirectory(prefix="tiderl-profile-job-") as tmp:
        raw, result = Path(tmp) / "job.raw", Path(tmp) / "job.json"
        child = (f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                 f"from job_vs_bare import one_token_job; "
                 f"json.dump(one_token_job({args.steps}), open({str(result)!r}, 'w'))")
        subprocess.run([spy, "record", "--subprocesses", "-r", str(args.rate), "-f", "raw",
                        "-o", str(raw), "--", sys.executable, "-c", child], check=True,
                       stdout=subprocess.DEVNULL)
        job = json.loads(result.read_text())
        processes = summarise(raw, args.rate)
    write_result(args.out, {
        "what": "py-spy over a real job's processes on the one-token guess game: CPU seconds "
                "per process (start-up apart) and its functions' inclusive shares",
        "steps": args.steps, "rate_hz": args.rate, "job": job, "processes": processes,
        "machine": machine_info()})


if __name__ == "__main__":
    main()
