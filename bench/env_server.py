"""Environment server throughput: steps/s and step latency at 256 concurrent sessions.

    python bench/env_server.py [--sessions 256] [--seconds 10] [--rounds 1] [--no-batch]
        [--compare-with DIR --compare-label REV] [--out bench/results/env_server.json]

Starts `tiderl env serve --envs guess` (no latency model) on a free 127.0.0.1 port, in its own
process, then runs ``--sessions`` concurrent episode loops in this one: start, binary-search
guesses until done, end. By default they share one :class:`HTTPEnvClient`, as a rank's tasks
do, so the calls they make in the same turn of the event loop travel in one ``/batch`` request
(``--no-batch``: each call its own request; ``--per-client``: sessions per client). A step is
one /observation answered, alone or as one call of a batch; steps are counted during
``--seconds`` after a 2 s warm-up, and a step's latency is the client-side time of its
``client.step``. ``steps_per_server_cpu_s`` and ``steps_per_client_cpu_s`` are each side's cost
(the server's CPU time includes the /start and /end calls; this process's includes the solver).
Loopback only; the server is stopped at the end. Also the time to render one ``gui`` screenshot
in process (``gui_render_ms``).

``--compare-with DIR``: a source tree of another revision (``git archive REV | tar -x -C DIR``),
whose own ``bench/env_server.py`` (its client and its server) runs as a subprocess, taking turns
with this revision ``--rounds`` times; the result holds both sides' rounds and the ratio of their
medians. Target: >= 2,000 steps/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from machine import machine_info, write_result

from tiderl.env.client import HTTPEnvClient
from tiderl.env.guess import GuessEnv
from tiderl.ports import free_port

TARGET_STEPS_S = 2000.0
WARMUP_S = 2.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(port: int, max_sessions: int) -> subprocess.Popen:
    script = Path(sys.executable).with_name("tiderl")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "tiderl.cli.main"]
    proc = subprocess.Popen([*cmd, "env", "serve", "--envs", "guess", "--port", str(port),
                             "--max-sessions", str(max_sessions)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("tiderl env serve exited")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("tiderl env serve did not answer /health in 30 s")


async def episodes(client: HTTPEnvClient, worker: int, until: float, begin: float,
                   latencies: list[float]) -> int:
    """Episodes back to back until ``until``; returns steps answered after ``begin``."""
    num_steps, seed = 0, worker * 100_000
    while time.perf_counter() < until:
        seed += 1
        started = await client.start("guess", "1 1000", seed)
        solver = GuessEnv()
        solver.reset("1 1000", seed)
        done = False
        while not done and time.perf_counter() < until:
            action = solver.solve()
            solver.step(action)
            sent = time.perf_counter()
            done = (await client.step(started.session, action)).done
            if sent >= begin:
                latencies.append(time.perf_counter() - sent)
                num_steps += 1
        await client.end(started.session)
    return num_steps


async def measure(url: str, sessions: int, seconds: float, per_client: int,
                  server_pid: int, batch: bool) -> dict:
    """``per_client`` sessions share one client (without batching, httpx's pool slows down with
    many connections: several small pools served 256 sessions faster than one large one)."""
    latencies: list[float] = []
    num_clients = -(-sessions // per_client)
    clients = [HTTPEnvClient(url, max_connections=per_client, timeout_s=60, batch=batch)
               for _ in range(num_clients)]
    try:
        begin = time.perf_counter() + WARMUP_S
        until = begin + seconds

        async def cpu_at_warmup() -> tuple[float, float]:
            await asyncio.sleep(WARMUP_S)
            return cpu_seconds(server_pid), time.process_time()

        cpu_at_begin = asyncio.ensure_future(cpu_at_warmup())
        counts = await asyncio.gather(*(
            episodes(clients[w // per_client], w, until, begin, latencies)
            for w in range(sessions)))
        elapsed = time.perf_counter() - begin
        server_at_begin, client_at_begin = await cpu_at_begin
        server_cpu_s = cpu_seconds(server_pid) - server_at_begin
        client_cpu_s = time.process_time() - client_at_begin
    finally:
        for client in clients:
            await client.close()
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    return {"steps": sum(counts), "seconds": round(elapsed, 3),
            "steps_per_s": round(sum(counts) / elapsed, 1),
            "server_cpu_s": round(server_cpu_s, 2),
            "steps_per_server_cpu_s": round(sum(counts) / max(server_cpu_s, 1e-9), 1),
            "client_cpu_s": round(client_cpu_s, 2),
            "steps_per_client_cpu_s": round(sum(counts) / max(client_cpu_s, 1e-9), 1),
            "step_latency_ms": {"p50": round(pick(0.50) * 1e3, 2),
                                "p99": round(pick(0.99) * 1e3, 2),
                                "mean": round(statistics.fmean(latencies) * 1e3, 2)}}


def gui_render_ms(frames: int = 50) -> dict:
    """Rendering one ``gui`` screenshot (draw + PNG encode), in process: best and median ms."""
    from tiderl.env.gui import GuiEnv, render

    env = GuiEnv()
    env.reset("form 4", seed=9)
    times = []
    for _ in range(frames):
        began = time.perf_counter()
        render(env.screen)
        times.append((time.perf_counter() - began) * 1e3)
    return {"best": round(min(times), 3), "median": round(statistics.median(times), 3)}


def run_here(args: argparse.Namespace) -> dict:
    """One measurement of this revision: its server, its client."""
    port = free_port()
    proc = start_server(port, max_sessions=2 * args.sessions)
    try:
        return asyncio.run(measure(f"http://127.0.0.1:{port}", args.sessions, args.seconds,
                                   args.per_client, proc.pid, not args.no_batch))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_there(tree: Path, args: argparse.Namespace) -> dict:
    """One measurement of the revision in ``tree``: its own benchmark (client and server),
    with its own defaults but for the load."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        subprocess.run([sys.executable, str(tree / "bench" / "env_server.py"), "--out", str(out),
                        "--sessions", str(args.sessions), "--seconds", str(args.seconds)],
                       env={**os.environ, "PYTHONPATH": str(tree)}, check=True,
                       stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    return {key: result[key] for key in FIGURES if key in result}


FIGURES = ("steps", "seconds", "steps_per_s", "server_cpu_s", "steps_per_server_cpu_s",
           "client_cpu_s", "steps_per_client_cpu_s", "step_latency_ms")


def median_of(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--per-client", type=int, default=0,
                        help="Sessions sharing one HTTPEnvClient (default: all of them; "
                             "with --no-batch, one).")
    parser.add_argument("--no-batch", action="store_true",
                        help="Each call its own request (no /batch).")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--compare-with", type=Path, default=None,
                        help="A source tree of another revision, measured in turns with this one.")
    parser.add_argument("--compare-label", default="", help="That revision's name.")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "env_server.json"))
    args = parser.parse_args()
    args.per_client = args.per_client or (1 if args.no_batch else args.sessions)
    rounds, theirs = [], []
    for _ in range(args.rounds):
        rounds.append(run_here(args))
        if args.compare_with is not None:
            theirs.append(run_there(args.compare_with, args))
    figures = min(rounds, key=lambda r: abs(r["steps_per_s"] - median_of(rounds, "steps_per_s")))
    result = {"benchmark": "env_server", "when": datetime.now(timezone.utc).isoformat(),
              "machine": machine_info(), "env": "guess", "latency_model": "none",
              "sessions": args.sessions, "sessions_per_client": args.per_client,
              "transport": "HTTP/1.1 over loopback (httpx, uvicorn)"
                           + ("" if args.no_batch else ", calls batched (/batch)"),
              **figures}
    if args.rounds > 1:
        result["rounds"] = rounds
    if theirs:
        result["compared_with"] = {
            "revision": args.compare_label or str(args.compare_with), "rounds": theirs,
            "ratio_steps_per_s": round(median_of(rounds, "steps_per_s")
                                       / median_of(theirs, "steps_per_s"), 2),
            "ratio_steps_per_server_cpu_s": round(
                median_of(rounds, "steps_per_server_cpu_s")
                / median_of(theirs, "steps_per_server_cpu_s"), 2)}
    result.update({"gui_render_ms": gui_render_ms(), "target_steps_per_s": TARGET_STEPS_S,
                   "met_target": figures["steps_per_s"] >= TARGET_STEPS_S})
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
