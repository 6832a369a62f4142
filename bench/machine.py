"""Machine facts recorded beside every benchmark result, and writing a result."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "implementation": platform.python_implementation()}


def write_result(path: str | Path, result: dict) -> None:
    """Write ``result`` as JSON to ``path`` (folders made as needed) and echo it on stdout."""
    text = json.dumps(result, indent=2) + "\n"
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
    sys.stdout.write(text)
