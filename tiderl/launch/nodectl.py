"""Stopping processes on a node, run there over SSH by the launcher and ``tiderl stop`` (the same
code the local executor uses; states are read from ``/proc/PID/stat`` over SFTP)::

    python -m tiderl.launch.nodectl stop [--grace S] PID...  {"PID": "terminated" | ...}

One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

from tiderl.launch.local import ProcessRecord, stop_together


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiderl.launch.nodectl")
    sub = parser.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop")
    stop.add_argument("--grace", type=float, default=10.0)
    stop.add_argument("pids", type=int, nargs="+")
    args = parser.parse_args(argv)
    records = [ProcessRecord(name=str(pid), kind="", pid=pid, log="", argv=[])
               for pid in args.pids]
    result = {int(name): how for name, how in stop_together(records, args.grace).items()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
