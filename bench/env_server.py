"""Environment server throughput: steps/s and step latency at 256 concurrent sessions.

    python bench/env_server.py [--sessions 256] [--seconds 10] [--out bench/results/env_server.json]

Starts `tiderl env serve --envs guess` (no latency model) on a free 127.0.0.1 port, then runs
``--sessions`` concurrent episode loops through :class:`HTTPEnvClient` (httpx AsyncClient; by
default one client with one connection per session, 256 connections in all: httpx's single pool
slows down badly past a few dozen connections): start, binary-search guesses until done, end.
Counts /observation calls answered during ``--seconds`` after a 2 s warm-up; latency is the
client-side time of each /observation. Loopback only; the server is stopped at the end.
Also the time to render one ``gui`` screenshot in process (``gui_render_ms``).
Target: >= 2,000 steps/s. On the 2-core development machine the httpx client, not the server, is
the bottleneck; ``steps_per_server_cpu_s`` is the server's own cost (its CPU time includes the
/start and /end calls).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from machine import machine_info, write_result

from tiderl.env.client import HTTPEnvClient
from tiderl.env.guess import GuessEnv

TARGET_STEPS_S = 2000.0
WARMUP_S = 2.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
                  server_pid: int) -> dict:
    """``per_client`` sessions share one client (httpx's pool slows down with many
    connections, so several small pools serve 256 sessions faster than one large one)."""
    latencies: list[float] = []
    num_clients = -(-sessions // per_client)
    clients = [HTTPEnvClient(url, max_connections=per_client, timeout_s=60)
               for _ in range(num_clients)]
    try:
        begin = time.perf_counter() + WARMUP_S
        until = begin + seconds

        async def server_cpu() -> float:
            await asyncio.sleep(WARMUP_S)
            return cpu_seconds(server_pid)

        cpu_at_begin = asyncio.ensure_future(server_cpu())
        counts = await asyncio.gather(*(
            episodes(clients[w // per_client], w, until, begin, latencies)
            for w in range(sessions)))
        elapsed = time.perf_counter() - begin
        server_cpu_s = cpu_seconds(server_pid) - await cpu_at_begin
    finally:
        for client in clients:
            await client.close()
    latencies.sort()
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    return {"steps": sum(counts), "seconds": round(elapsed, 3),
            "steps_per_s": round(sum(counts) / elapsed, 1),
            "server_cpu_s": round(server_cpu_s, 2),
            "steps_per_server_cpu_s": round(sum(counts) / max(server_cpu_s, 1e-9), 1),
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--per-client", type=int, default=1,
                        help="Sessions sharing one httpx AsyncClient (its connection pool).")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "env_server.json"))
    args = parser.parse_args()
    port = free_port()
    proc = start_server(port, max_sessions=2 * args.sessions)
    try:
        figures = asyncio.run(measure(f"http://127.0.0.1:{port}", args.sessions, args.seconds,
                                     args.per_client, proc.pid))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    result = {"benchmark": "env_server", "when": datetime.now(timezone.utc).isoformat(),
              "machine": machine_info(), "env": "guess", "latency_model": "none",
              "sessions": args.sessions, "sessions_per_client": args.per_client,
              "transport": "HTTP/1.1 over loopback (httpx, uvicorn)",
              **figures, "gui_render_ms": gui_render_ms(), "target_steps_per_s": TARGET_STEPS_S,
              "met_target": figures["steps_per_s"] >= TARGET_STEPS_S}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
