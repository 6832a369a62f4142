"""What the launcher and ``tiderl stop`` run on a node over SSH: stopping processes (the same
code the local executor uses; states are read from ``/proc/PID/stat`` over SFTP), and resolving
a hub id to the node's cache (``tiderl.models.hub``, downloading what is missing)::

    python -m tiderl.launch.nodectl stop [--grace S] PID...  {"PID": "terminated" | ...}
    python -m tiderl.launch.nodectl model ID [--revision R]  {"folder", "repo_id", "revision"}
                                                             or {"error": LINE}, exit 2

One JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from tiderl.launch.local import ProcessRecord, stop_together
from tiderl.models.hub import HubError, resolve_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiderl.launch.nodectl")
    sub = parser.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop")
    stop.add_argument("--grace", type=float, default=10.0)
    stop.add_argument("pids", type=int, nargs="+")
    model = sub.add_parser("model")
    model.add_argument("path")
    model.add_argument("--revision", default="")
    args = parser.parse_args(argv)
    if args.command == "model":
        try:
            print(json.dumps(asdict(resolve_model(args.path, args.revision))))
        except HubError as exc:
            print(json.dumps({"error": str(exc)}))
            return 2
        return 0
    records = [ProcessRecord(name=str(pid), kind="", pid=pid, log="", argv=[])
               for pid in args.pids]
    result = {int(name): how for name, how in stop_together(records, args.grace).items()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
