"""Bus round trip and echo throughput of TurnReport, with CurveZMQ vs without, side by side.

    python bench/bus.py [--round-trips 2000] [--seconds 3] [--out bench/results/bus.json]

The coordinator end (BusServer, ROUTER) runs here and echoes every message back through
``recv``/``send`` (decode and re-encode, as the coordinator would); the rank end (BusClient,
DEALER) is a separate process that measures: RTT of one message at a time (after 200 warm-up
round trips), then echoed messages per second with up to 256 in flight. tcp on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from machine import machine_info, write_result

from tiderl.runtime.bus import (
    BusClient,
    BusServer,
    TurnReport,
    encode,
    load_job_keys,
    make_job_keys,
    rank_identity,
)

WINDOW = 256
REPORT = TurnReport(rank=0, task_id="task-000123", tokens=48, context_tokens=3072, done=False,
                    version=7)


def measure_as_rank(endpoint: str, keys_dir: str, round_trips: int, seconds: float) -> dict:
    """The DEALER side (its own process): RTT percentiles, then echoed msg/s."""
    keys = load_job_keys(keys_dir, 0) if keys_dir != "none" else None
    with BusClient(endpoint, keys, rank_identity(0)) as bus:
        rtts = []
        for i in range(200 + round_trips):
            sent = time.perf_counter()
            bus.send(REPORT)
            assert bus.recv(timeout_s=10) == REPORT
            if i >= 200:
                rtts.append(time.perf_counter() - sent)
        rtts.sort()
        num_sent = num_echoed = 0
        begin = time.perf_counter()
        while time.perf_counter() - begin < seconds:
            while num_sent - num_echoed < WINDOW:
                bus.send(REPORT)
                num_sent += 1
            bus.recv(timeout_s=10)
            num_echoed += 1
        elapsed = time.perf_counter() - begin
        while num_echoed < num_sent:  # drain, so the echo side sees a quiet socket at the end
            bus.recv(timeout_s=10)
            num_echoed += 1
    pick = lambda q: rtts[min(len(rtts) - 1, int(q * len(rtts)))]  # noqa: E731
    return {"rtt_us": {"p50": round(pick(0.50) * 1e6, 1), "p99": round(pick(0.99) * 1e6, 1)},
            "echoed_msgs_per_s": round(num_echoed / elapsed)}


def run(curve: bool, round_trips: int, seconds: float) -> dict:
    """Serve echoes here while a rank process measures; returns its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        keys = make_job_keys(Path(tmp) / "keys", 1) if curve else None
        keys_arg = str(Path(tmp) / "keys") if curve else "none"
        with BusServer(keys) as server:
            proc = subprocess.Popen([sys.executable, __file__, "--rank", server.endpoint,
                                     keys_arg, "--round-trips", str(round_trips),
                                     "--seconds", str(seconds)], stdout=subprocess.PIPE)
            while proc.poll() is None:
                got = server.recv(timeout_s=0.1)
                if got is not None:
                    server.send(*got)
            out = proc.stdout.read() if proc.stdout else b""
    if proc.returncode != 0:
        raise RuntimeError(f"rank process exited {proc.returncode}")
    return json.loads(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rank", nargs=2, metavar=("ENDPOINT", "KEYS_DIR"),
                        help=argparse.SUPPRESS)  # internal: the measuring rank process
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bus.json"))
    args = parser.parse_args()
    if args.rank:
        print(json.dumps(measure_as_rank(*args.rank, args.round_trips, args.seconds)))
        return 0
    result = {"benchmark": "bus", "when": datetime.now(timezone.utc).isoformat(),
              "machine": machine_info(), "transport": "tcp 127.0.0.1, ROUTER (echo) / DEALER",
              "message": "TurnReport", "payload_bytes": len(encode(REPORT)[2]),
              "in_flight": WINDOW, "round_trips": args.round_trips,
              "plain": run(False, args.round_trips, args.seconds),
              "curve": run(True, args.round_trips, args.seconds)}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
