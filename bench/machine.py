"""Machine facts recorded beside every benchmark result, and writing a result."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path


def machine_info() -> dict:
    """The CPU (model name, and the widest SIMD extension its flags list: machines named alike
    here were AVX-512 and AVX2 ones, whose engine decode steps differed 1.5-2.8x), cores,
    Python."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    simd = next((name for name in ("avx512f", "avx2", "avx", "sse4_2") if name in flags), None)
    return {"cpu": cpu, "simd": simd, "cores": os.cpu_count(),
            "python": platform.python_version(), "platform": platform.platform(),
            "implementation": platform.python_implementation()}


def write_result(path: str | Path, result: dict) -> None:
    """Write ``result`` as JSON to ``path`` (folders made as needed) and echo it on stdout."""
    text = json.dumps(result, indent=2) + "\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    sys.stdout.write(text)


class CpuSampler:
    """Machine-wide CPU busy share over a window, from ``/proc/stat`` sampled every ``period_s``
    (wall clock), so that a benchmark can tell a policy that waits from a machine that is full."""

    def __init__(self, period_s: float = 0.2) -> None:
        import threading

        self.period_s = period_s
        self.samples: list[tuple[float, int, int]] = []  # (time, busy jiffies, all jiffies)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _read() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
        return total - idle, total

    def _run(self) -> None:
        import time

        while not self._stop.is_set():
            self.samples.append((time.time(), *self._read()))
            self._stop.wait(self.period_s)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def busy_share(self, start: float, end: float) -> float | None:
        """The share of all cores busy between wall times ``start`` and ``end`` (the samples
        just inside them), None without two samples in the window."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])
