"""The job's daemons, as the launcher starts them (not a user command):

    python -m tiderl.runtime env         --run-dir D [--host H] --port P
    python -m tiderl.runtime coordinator --run-dir D --port P --pub-port Q [--metrics-port M]
                                         [--env-url http://...]
    python -m tiderl.runtime rank        --run-dir D --rank R --bus tcp://... --dist tcp://...
                                         --env-url http://... [--device cpu] [--threads 1]
                                         [--cpu-slot I/N] [--engine-url http://...]

Each reads the resolved profile and the bus keys from the run folder the launcher prepared.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tiderl.core.types import Role
from tiderl.profile import load_profile, profile_to_dict
from tiderl.runtime.signals import exit_on_sigterm

if TYPE_CHECKING:
    from tiderl.runtime.prom import MetricsExporter

PROFILE_FILE = "profile.yaml"
ROLES_FILE = "roles.json"


def _env(args: argparse.Namespace) -> int:
    from tiderl.env.server import serve
    from tiderl.models.chat import agent_model

    profile = load_profile(str(args.run_dir / PROFILE_FILE))
    model = profile.model
    described = agent_model(model.path, model.size, profile.engine.kv_cache_tokens,
                            model.chat_template) if profile.env.agents else None
    serve(profile.env, args.host, args.port, model=described)
    return 0


def _coordinator(args: argparse.Namespace) -> int:
    from tiderl.runtime.bus import BusServer, load_job_keys
    from tiderl.runtime.coordinator import Coordinator, CoordinatorError
    from tiderl.runtime.log_backends import LoggingBackendError, open_writers
    from tiderl.runtime.report import write_final_report
    from tiderl.runtime.resume import resume_hint, resume_request
    from tiderl.runtime.run_log import RunLog

    profile = load_profile(str(args.run_dir / PROFILE_FILE))
    roles = [Role(r) for r in json.loads((args.run_dir / ROLES_FILE).read_text())]
    keys = load_job_keys(args.run_dir / "keys", "coordinator")
    logger = logging.getLogger("tiderl.coordinator")
    try:
        writers = open_writers(profile.logging, args.run_dir, profile_to_dict(profile))
    except LoggingBackendError as exc:  # before anything binds: the launcher shows this line
        logger.error("%s", exc)
        return 2
    exporter = _exporter(profile.runtime.bus_host, args.metrics_port)
    run_log = RunLog(args.run_dir, time.monotonic, exporter, writers)
    code = 0
    with BusServer(keys, profile.runtime.bus_host, args.port, args.pub_port) as server:
        coordinator = Coordinator(profile, server, roles, run_log, time.monotonic,
                                  resume=resume_request(args.run_dir), env_url=args.env_url)
        try:
            coordinator.run()
        except CoordinatorError as exc:  # the job cannot go on: it stops, resumable
            hint = resume_hint(args.run_dir, profile.trainer.tensor_parallel,
                               profile.runtime.run_dir)
            run_log.event("stop", reason=str(exc), state="failed", resume=hint,
                          groups=coordinator.controller.feed.count.as_dict())
            logger.error("%s%s", exc, f"; {hint}" if hint else "")
            code = 1
        except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C, `tiderl stop` (SIGTERM)
            state = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped"
            hint = resume_hint(args.run_dir, profile.trainer.tensor_parallel,
                               profile.runtime.run_dir)
            run_log.event("stop", reason=state, state=state, resume=hint,
                          groups=coordinator.controller.feed.count.as_dict())
            code = 130 if state == "interrupted" else 143
        finally:
            run_log.close()
            if exporter is not None:
                exporter.close()
    write_final_report(args.run_dir, title=f"TideRL run {args.run_dir.name}",
                       plots=profile.report.plots)
    return code


def _exporter(host: str, port: int) -> MetricsExporter | None:
    """The Prometheus exporter serving ``http://host:port/metrics``, or None for port 0."""
    if port <= 0:
        return None
    from tiderl.runtime.prom import MetricsExporter

    exporter = MetricsExporter()
    exporter.start(host, port)
    return exporter


def _rank(args: argparse.Namespace) -> int:
    """Run one rank to its Shutdown."""
    import asyncio

    import torch.distributed as dist

    from tiderl.runtime.affinity import parse_slot, pin_to_slot
    from tiderl.runtime.rank import RankArgs, RankDaemon

    profile = load_profile(str(args.run_dir / PROFILE_FILE))
    roles = [Role(r) for r in json.loads((args.run_dir / ROLES_FILE).read_text())]
    slot = parse_slot(args.cpu_slot) if args.cpu_slot else None
    if slot is not None:  # first: torch's threads start on the pinned cores
        cores = pin_to_slot(*slot)
        logging.getLogger("tiderl.rank").info("rank %d pinned to cores %s (slot %d/%d)",
                                              args.rank, ",".join(map(str, cores)), *slot)
    daemon = RankDaemon(RankArgs(
        rank=args.rank, world_size=len(roles), run_dir=args.run_dir, bus=args.bus,
        dist_init=args.dist, env_url=args.env_url, role=roles[args.rank], device=args.device,
        threads=args.threads, cpu_slot=slot, engine_url=args.engine_url,
        dist_backend=args.dist_backend, memory_fraction=args.memory_fraction), profile)
    daemon.setup(roles)
    try:
        asyncio.run(daemon.run())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiderl.runtime")
    sub = parser.add_subparsers(dest="daemon", required=True)
    env = sub.add_parser("env")
    coord = sub.add_parser("coordinator")
    rank = sub.add_parser("rank")
    for p in (env, coord, rank):
        p.add_argument("--run-dir", type=Path, required=True)
    env.add_argument("--host", default="127.0.0.1", help="address to serve on")
    env.add_argument("--port", type=int, required=True)
    coord.add_argument("--port", type=int, required=True)
    coord.add_argument("--pub-port", type=int, required=True)
    coord.add_argument("--metrics-port", type=int, default=0,
                       help="serve Prometheus /metrics on this port (0: none)")
    coord.add_argument("--env-url", default="",
                       help="the environment service (a dead rank's sessions are ended there)")
    rank.add_argument("--rank", type=int, required=True)
    rank.add_argument("--bus", required=True)
    rank.add_argument("--dist", required=True)
    rank.add_argument("--env-url", required=True)
    rank.add_argument("--device", default="cpu")
    rank.add_argument("--threads", type=int, default=1)
    rank.add_argument("--dist-backend", default="", choices=("", "gloo", "nccl"),
                      help="the world's backend (default: nccl on CUDA, else gloo; gloo where "
                           "ranks share a device)")
    rank.add_argument("--memory-fraction", type=float, default=0.0,
                      help="cap this process's CUDA memory at this share of its device (ranks "
                           "sharing it; 0: no cap)")
    rank.add_argument("--cpu-slot", default="",
                      help="I/N: pin to the I-th of N shares of this process's cores "
                           "(runtime.cpu_affinity: spread)")
    rank.add_argument("--engine-url", default="",
                      help="this rank's engine server (engine backends other than embedded)")
    args = parser.parse_args(argv)
    name = args.daemon if args.daemon != "rank" else f"rank{args.rank}"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpx2"):  # a line per request (httpx2: the openai SDK's)
        logging.getLogger(noisy).setLevel(logging.WARNING)
    exit_on_sigterm()  # run finally blocks, then exit
    # Ctrl-C as the launcher passes it on (even if this process started with SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return {"env": _env, "coordinator": _coordinator, "rank": _rank}[args.daemon](args)
    finally:
        # what is left is the interpreter's exit: its last garbage collections walk every object
        # torch and the model made (1-2 s of a rank's exit on 2 cores, 0.4 s frozen). Files
        # the daemon writes are closed (or line-buffered) by then; atexit handlers still run.
        gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
