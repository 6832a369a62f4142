"""What the launcher and ``tiderl stop`` run on a node over SSH: stopping processes (the same
code the local executor uses; states are read from ``/proc/PID/stat`` over SFTP), resolving a
hub id to the node's cache (``tiderl.models.hub``, downloading what is missing), and picking the
ports its daemons listen on::

    python -m tiderl.launch.nodectl stop [--grace S] PID...  {"PID": "terminated" | ...}
    python -m tiderl.launch.nodectl model ID [--revision R]  {"folder", "repo_id", "revision"}
                                                             or {"error": LINE}, exit 2
    python -m tiderl.launch.nodectl ports N [--host H]       [port, ...] or {"error": LINE},
                                                             exit 2 (``tiderl.ports``: free
                                                             ones, outside the node's ephemeral
                                                             range where it leaves enough)

One JSON line on stdout. And, as a Slurm job step's one task (:mod:`tiderl.launch.slurm`), the
supervisor of a node's processes::

    python -m tiderl.launch.nodectl supervise SPEC.json
        SPEC: {"processes": [{"name", "argv", "env", "log"}, ...]}
        out:  {"started": {name: pid}, "step": SLURM_STEP_ID}, then {"exited": name, "pid": p,
              "code": c}
              per process as it ends, {"stopped": id, "outcome": {name: how}} per stop
        in:   {"kill": name} | {"stop": [names], "grace_s": s, "id": id} | {"exit": true}

Each process starts in its own session (as the local executor starts them), its output to its
log. ``exit`` stops what still runs (2 s grace) and ends the step; stdin closing without it (the
launcher is gone) leaves the processes running until they end, as a local job's outlive a
killed launcher; SIGTERM (``scancel --signal=TERM`` by ``tiderl stop``) stops them (10 s grace)
and ends the step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from tiderl.launch.local import ProcessRecord, stop_together
from tiderl.models.hub import HubError, Resolved, resolve_model
from tiderl.ports import NoFreePorts, listen_ports


def last_answer(stdout: str) -> object | None:
    """The JSON value on the last line a command of this module printed; None without one."""
    try:
        return json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def read_model_answer(stdout: str, node: str) -> Resolved | None:
    """What ``nodectl model`` said on ``node``: the resolved model (HubError naming the node for
    its error line; None when it printed no answer)."""
    answer = last_answer(stdout)
    if answer is None:
        return None
    if "error" in answer:
        raise HubError(f"node {node}: {answer['error']}")
    return Resolved(**answer)


def supervise(spec_file: str) -> int:
    """Start the spec's processes, report them, obey stdin's commands (the module docstring)."""
    spec = json.loads(Path(spec_file).read_text())
    lock = threading.Lock()

    def say(message: dict) -> None:
        with lock:
            print(json.dumps(message), flush=True)

    popens: dict[int, subprocess.Popen] = {}
    records: dict[str, ProcessRecord] = {}
    for p in spec["processes"]:
        Path(p["log"]).parent.mkdir(parents=True, exist_ok=True)
        with open(p["log"], "ab") as log:
            proc = subprocess.Popen(p["argv"], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **p["env"]})
        popens[proc.pid] = proc
        records[p["name"]] = ProcessRecord(name=p["name"], kind="", pid=proc.pid,
                                           log=p["log"], argv=p["argv"])
    say({"started": {name: r.pid for name, r in records.items()},
         "step": os.environ.get("SLURM_STEP_ID", "")})
    done = threading.Event()

    def watch() -> None:
        reported: set[str] = set()
        while len(reported) < len(records):
            for name, record in records.items():
                code = popens[record.pid].poll()
                if code is not None and name not in reported:
                    reported.add(name)
                    say({"exited": name, "pid": record.pid, "code": code})
            time.sleep(0.1)
        done.set()

    threading.Thread(target=watch, daemon=True).start()

    def terminated(signum: int, frame: object) -> None:  # scancel --signal=TERM
        stop_together(list(records.values()), 10.0, popens)
        os._exit(0)

    signal.signal(signal.SIGTERM, terminated)
    for line in sys.stdin:
        try:
            command = json.loads(line)
        except ValueError:
            continue
        if "kill" in command and command["kill"] in records:
            stop_together([records[command["kill"]]], 0.0, popens)
        elif "stop" in command:
            chosen = [records[n] for n in command["stop"] if n in records]
            outcome = stop_together(chosen, float(command.get("grace_s", 10.0)), popens)
            say({"stopped": command.get("id"), "outcome": outcome})
        elif command.get("exit"):
            stop_together(list(records.values()), 2.0, popens)
            done.wait(5.0)
            return 0
    done.wait()  # the launcher is gone: the processes go on until they end
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiderl.launch.nodectl")
    sub = parser.add_subparsers(dest="command", required=True)
    stop = sub.add_parser("stop")
    stop.add_argument("--grace", type=float, default=10.0)
    stop.add_argument("pids", type=int, nargs="+")
    model = sub.add_parser("model")
    model.add_argument("path")
    model.add_argument("--revision", default="")
    supervised = sub.add_parser("supervise")
    supervised.add_argument("spec")
    ports = sub.add_parser("ports")
    ports.add_argument("count", type=int)
    ports.add_argument("--host", default="0.0.0.0")
    args = parser.parse_args(argv)
    if args.command == "ports":
        try:
            print(json.dumps(listen_ports(args.count, args.host)))
        except NoFreePorts as exc:
            print(json.dumps({"error": str(exc)}))
            return 2
        return 0
    if args.command == "supervise":
        return supervise(args.spec)
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
