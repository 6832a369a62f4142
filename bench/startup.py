"""Start-up of the commands a new user runs first, each a fresh process, best and median of 5.

    python bench/startup.py [--out bench/results/startup.json]

- ``tiderl --help``;
- ``tiderl model init --out DIR`` (tiny, word tokenizer) into a new folder;
- ``tiderl engine serve --model DIR`` on a free loopback port: seconds until the port answers
  (``/health`` 503 ``loading``) and until ``/health`` answers 200 (ready to generate);
- ``python -c "import torch"``: the floor under anything that runs the model.

Targets (issue 20, a quiet machine): --help <= 0.5 s, model init <= 5 s, engine serve answers
/health <= 2 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from machine import machine_info, write_result

from tiderl.ports import free_port

REPEATS = 5
TIDERL = [str(Path(sys.executable).parent / "tiderl")]  # the console script, as a user runs it
TARGETS = {"help_s": 0.5, "model_init_s": 5.0, "serve_answers_s": 2.0}


def _timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def _serve(model: Path) -> tuple[float, float]:
    """Seconds until the port answers, and until /health says 200; fails when the server
    exits first."""
    port = free_port()
    start, answered = time.perf_counter(), None
    proc = subprocess.Popen([*TIDERL, "engine", "serve", "--model", str(model), "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with httpx.Client(timeout=1.0) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"engine serve exited: {proc.stderr.read().decode()}")
                try:
                    status = client.get(f"http://127.0.0.1:{port}/health").status_code
                except httpx.TransportError:
                    status = None
                now = time.perf_counter() - start
                if status is not None and answered is None:
                    answered = now
                if status == 200:
                    return answered, now
                time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait()


def _summary(values: list[float]) -> dict:
    return {"best": round(min(values), 2), "median": round(statistics.median(values), 2),
            "all": [round(v, 2) for v in values]}


def run_bench() -> dict:
    folder = Path(tempfile.mkdtemp(prefix="tiderl-startup-"))
    try:
        runs: dict[str, list[float]] = {k: [] for k in (
            "help_s", "model_init_s", "serve_answers_s", "serve_ready_s", "import_torch_s")}
        for i in range(REPEATS):  # the commands take turns, so that drift hits each alike
            runs["help_s"].append(_timed([*TIDERL, "--help"]))
            runs["model_init_s"].append(_timed([*TIDERL, "model", "init", "--out",
                                                str(folder / f"m{i}")]))
            answered, ready = _serve(folder / "m0")
            runs["serve_answers_s"].append(answered)
            runs["serve_ready_s"].append(ready)
            runs["import_torch_s"].append(_timed([sys.executable, "-c", "import torch"]))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {k: _summary(v) for k, v in runs.items()}
    result["targets"] = TARGETS
    result["meets_targets"] = all(result[k]["median"] <= v for k, v in TARGETS.items())
    result["machine"] = machine_info() | {"load_average": os.getloadavg()}
    result["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "startup.json"))
    args = parser.parse_args()
    write_result(args.out, run_bench())
    return 0


if __name__ == "__main__":
    sys.exit(main())
