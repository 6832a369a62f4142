"""Run a job: prepare its run folder, start its processes, follow it, stop it (:func:`run_job`,
the same steps on this machine and on the nodes of hosts.yaml; only the executor differs).

    runs/<job>/  profile.yaml (resolved)  roles.json  keys/ (CurveZMQ, 0700/0600)  job.json
                 logs/<process>.log  metrics.jsonl  events.jsonl  checkpoints/  report.md  *.png
                 weights/ (versions for engine servers)

    run_local / run_ssh:  check, ports, the plan (built once, from those ports), the executor
    run_job(plan, executor):
        run folder (or a resumed job's) ─> job.json ─> push (SSH) ─> start every process
        ─> wait for the environment service ─> follow the snapshots until the coordinator exits
        ─> Ctrl-C: interrupt the coordinator ─> stop what is left (SSH: fetch the results)

The environment service starts first (the launcher waits for its /health), then the engine
servers (a server backend), the coordinator and the rank daemons (``python -m tiderl.runtime
...``); each rank waits for its server before its Hello. The launcher follows the coordinator's
PUB snapshots (what ``tiderl top`` reads) and ends when the coordinator exits: it gives the ranks a
grace period to save and exit, then stops whatever is left (SIGTERM, then SIGKILL by process
group). A failed process, Ctrl-C or SIGTERM stop the whole job: no process is left behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import httpx
import yaml

from tiderl.core.quote import cut
from tiderl.engine.config import VLLM_NO_IMAGES
from tiderl.launch.device_memory import check_device_memory, gpu_memory_bytes
from tiderl.launch.local import (
    JobRecord,
    LaunchError,
    LaunchRefused,
    LocalExecutor,
    ProcessRecord,
)
from tiderl.launch.plan import (
    LOCAL_HOST,
    RUN_PROFILE,
    Endpoints,
    LaunchPlan,
    ProcessSpec,
    plan_local,
    port_names,
)
from tiderl.launch.resume import prepare_resume
from tiderl.launch.run_folders import kept_if_used, last_stop, new_run_dir
from tiderl.models.config import EMBEDDED_MODEL_TYPES, VL_MODEL_TYPES, model_type
from tiderl.models.hub import HubError, Resolved, is_hub_id, resolve_model
from tiderl.ports import NoFreePorts, listen_ports
from tiderl.profile import Profile, profile_to_dict
from tiderl.runtime.bus import Snapshot, Subscriber, load_job_keys, make_job_keys
from tiderl.runtime.log_backends import missing_backends, missing_line
from tiderl.runtime.recording import RecordingError, check_recording

log = logging.getLogger("tiderl.launch")

ENV_START_TIMEOUT_S = 60.0
RANK_EXIT_GRACE_S = 60.0
ENV_RESTARTS = 3  # a job's environment service is started again this many times at most


class Executor(Protocol):
    """What running a job needs of its executor: :class:`tiderl.launch.local.LocalExecutor`, or
    :class:`tiderl.launch.remote.SSHExecutor` for the nodes of hosts.yaml."""

    job: JobRecord  # the processes it started, as they start

    def push(self, plan: LaunchPlan) -> None:
        """Copy what the daemons read of the run folder to where they run."""

    def start(self, specs: Sequence[ProcessSpec]) -> None: ...

    def exited(self) -> list[tuple[ProcessRecord, int]]: ...

    def kill(self, record: ProcessRecord) -> None: ...

    def interrupt(self) -> None:
        """Ctrl-C: have the coordinator end the job as interrupted, if it can."""

    def shut_down(self, grace_s: float) -> None:
        """Stop every process left (and bring the results to the run folder)."""


@dataclass(frozen=True)
class JobResult:
    job_id: str
    run_dir: Path
    exit_code: int  # the coordinator's
    report: Path | None
    last: Snapshot | None
    stop_reason: str = ""  # why it stopped, from its last stop event ("" if it has none)
    resume_hint: str = ""  # the line that resumes it ("" if there is no checkpoint)


def job_info(profile: Profile, ep: Endpoints, **extra) -> dict:
    """job.json's ``info``: what the CLI needs to reach the job (see tiderl.launch.run_folders)."""
    return {"system": profile.runtime.system, "steps": profile.job.steps,
            "ports": dict(ep.ports), "bus": ep.bus, "pub": ep.pub, "metrics": ep.metrics,
            **extra}


def prepare_run_dir(profile: Profile, plan: LaunchPlan, run_dir: Path,
                    resume: bool = False) -> None:
    """The files every daemon reads, into ``run_dir`` (a new job's is made by
    :func:`tiderl.launch.run_folders.new_run_dir`): the resolved profile, the initial roles,
    the bus keys. A resumed job's roles are those of its newest complete checkpoint
    (:func:`tiderl.launch.resume.prepare_resume`), its keys new (no process of the old run may
    speak to the new one); metrics, events and logs are appended to."""
    if resume:
        roles = prepare_resume(profile, run_dir)
        shutil.rmtree(run_dir / "keys", ignore_errors=True)
    else:
        roles = [p.role for p in plan.ranks]
    (run_dir / RUN_PROFILE).write_text(yaml.safe_dump(profile_to_dict(profile),
                                                      sort_keys=False))
    (run_dir / "roles.json").write_text(json.dumps([r.value for r in roles]))
    make_job_keys(run_dir / "keys", profile.runtime.num_ranks)


def local_endpoints(profile: Profile, ports: Mapping[str, int | str]) -> Endpoints:
    """Where the processes of a job on this machine meet (a replay has no environment)."""
    env_url = "" if profile.runtime.replay else \
        profile.env.url or f"http://127.0.0.1:{ports['env']}"
    return Endpoints(coordinator=profile.runtime.bus_host, env_url=env_url,
                     dist_host="127.0.0.1", ports=ports)


NVIDIA_DRIVER = Path("/proc/driver/nvidia/version")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # a folder per GPU the driver sees


def with_model_resolved(profile: Profile,
                        resolvers: Mapping[str, Callable[[str, str], Resolved]]
                        ) -> tuple[Profile, dict]:
    """The profile every daemon reads, and job.json's ``model`` entry: a ``model.path`` that is
    a hub id is resolved on each node (``resolvers``, by node name, in order: the first at
    ``model.revision``, the others at the commit it got), and becomes that folder with the
    commit pinned in ``model.revision``. Nodes whose caches sit in different folders are
    refused (one line: the profile names one folder for every node), as is any failure."""
    model = profile.model
    if not is_hub_id(model.path):
        return profile, {}
    got: dict[str, Resolved] = {}
    try:
        for node, resolve in resolvers.items():
            first = next(iter(got.values()), None)
            got[node] = resolve(model.path, first.revision if first else model.revision)
    except HubError as exc:
        raise LaunchRefused(str(exc)) from None
    resolved = next(iter(got.values()))
    folders = {r.folder for r in got.values()}
    if len(folders) > 1:
        raise LaunchRefused(f"model.path {model.path}: the nodes' hub caches are in different "
                            f"folders ({', '.join(f'{n}: {r.folder}' for n, r in got.items())}); "
                            "give every node the same HF_HOME")
    profile = replace(profile, model=replace(model, path=resolved.folder,
                                             revision=resolved.revision))
    return profile, {"model": {"id": resolved.repo_id, "revision": resolved.revision,
                               "folder": resolved.folder, "nodes": list(got)}}


def check_here(profile: Profile) -> None:
    """What a job on this machine needs and can be checked before anything starts
    (LaunchRefused naming the key): the model folder (a hub id only once resolved), for
    ``runtime.device: cuda`` an NVIDIA driver, the libraries of ``logging.backends`` (the
    coordinator imports them), and the recording ``runtime.replay`` names (its steps, of this
    job's shape). A path the system refuses (a name too long) is refused naming its key."""
    path = profile.model.path
    if is_hub_id(path):  # a dry run: the launch resolves it (with_model_resolved) and checks it
        path = ""
    try:
        is_model_folder = not path or (Path(path) / "config.json").is_file()
    except OSError as exc:
        raise LaunchRefused(f"model.path {cut(path)}: {exc.strerror}") from None
    if not is_model_folder:
        raise LaunchRefused(f"model.path {cut(path)}: no config.json there (an HF model "
                            "folder or a hub id; tiderl model init makes one)")
    if path:
        check_architecture(profile)
    if profile.runtime.device == "cuda" and not NVIDIA_DRIVER.exists():
        raise LaunchRefused(f"runtime.device is cuda, but this machine has no NVIDIA driver "
                            f"({NVIDIA_DRIVER} is missing)")
    if profile.runtime.device == "cuda" and path:
        why = check_device_memory(profile, gpu_memory_bytes(), visible_cuda_devices(
            os.environ.get("CUDA_VISIBLE_DEVICES")))
        if why:
            raise LaunchRefused(why)
    missing = missing_backends(profile.logging.backends)
    if missing:
        raise LaunchRefused(missing_line(missing))
    if profile.runtime.replay:
        try:
            check_recording(profile)
        except RecordingError as exc:
            raise LaunchRefused(f"runtime.replay: {exc}") from None
        except OSError as exc:
            raise LaunchRefused(f"runtime.replay {cut(profile.runtime.replay)}: "
                                f"{exc.strerror}") from None


def check_architecture(profile: Profile) -> None:
    """A model folder of another architecture than Qwen2 or Qwen2-VL (what the embedded engine,
    ``tiderl engine serve`` and every trainer backend but megatron build) rolls out on vLLM or
    SGLang only and trains with DDP or FSDP2; a Qwen2-VL one rolls out on any backend but vLLM
    (no images beside token ids) and trains with DDP or FSDP2."""
    try:
        kind = model_type(profile.model.path)
    except ValueError as exc:
        raise LaunchRefused(f"model.path: {exc}") from None
    if kind == "qwen2":
        return
    if kind in VL_MODEL_TYPES and profile.engine.backend == "vllm":
        raise LaunchRefused(f"model.path is a {kind} model: {VLLM_NO_IMAGES}")
    if kind not in EMBEDDED_MODEL_TYPES and profile.engine.backend not in ("vllm", "sglang"):
        raise LaunchRefused(f"model.path is a {kind} model: engine.backend "
                            f"{profile.engine.backend} runs Qwen2 and Qwen2-VL only; use vllm or "
                            "sglang (docs/models.md)")
    if profile.trainer.backend == "megatron":
        raise LaunchRefused(f"model.path is a {kind} model: trainer.backend megatron builds "
                            "Qwen2 only; use ddp or fsdp2 (docs/models.md)")


def wait_for_env(url: str, executor: Executor, ended: set[int] = frozenset()) -> None:
    """Until the service at ``url`` answers /health; LaunchError if a process of the job
    (other than the ``ended`` pids, handled already) exits meanwhile."""
    deadline = time.monotonic() + ENV_START_TIMEOUT_S
    # one client for every poll: a new one loads the CA bundle each time (40 ms of CPU, taken
    # from the ranks importing torch meanwhile)
    with httpx.Client(timeout=1.0) as http:
        while time.monotonic() < deadline:
            for record, code in executor.exited():
                if record.pid not in ended:
                    raise LaunchError(exit_line(record, code))
            try:
                if http.get(f"{url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise LaunchError(f"the environment service did not answer at {url} within "
                      f"{ENV_START_TIMEOUT_S:.0f} s")


def run_local(profile: Profile, *, run_root: Path | None = None, job_id: str | None = None,
              on_snapshot: Callable[[Snapshot], None] | None = None,
              on_start: Callable[[JobRecord], None] | None = None,
              launcher_pid: int | None = None, resume: Path | None = None) -> JobResult:
    """Run the job on this machine (:func:`run_job`): check what it needs here, pick its ports,
    plan it. ``launcher_pid`` (the CLI's own) lets ``tiderl stop`` stop the job through its
    launcher. ``resume``: the run folder of a job to go on with
    (:mod:`tiderl.launch.resume`); else a new one is made in ``run_root``, named ``job_id``
    or a new id."""
    profile, model = with_model_resolved(profile, {LOCAL_HOST: resolve_model})
    check_here(profile)
    run_dir = resume or new_run_dir(run_root or Path(profile.runtime.run_dir),
                                    profile.runtime.system, job_id)
    with kept_if_used(run_dir):  # a resumed job's folder is never empty: it stays
        plan = local_plan(profile, run_dir, local_ports(profile))
        job = JobRecord(run_dir.name, str(run_dir), time.time(),
                        info=job_info(profile, plan.endpoints, launcher_pid=launcher_pid,
                                      **model))
        return run_job(profile, plan, LocalExecutor(job), resume=resume is not None,
                       on_snapshot=on_snapshot, on_start=on_start)


def local_ports(profile: Profile) -> dict[str, int | str]:
    """A free port here for each the job's processes listen on (a Slurm allocation's nodes run
    the launcher's system image: the same probe stands for them, and a port taken on a node
    fails the job at start with its process's log naming it)."""
    names = port_names(profile)
    try:
        return dict(zip(names, listen_ports(len(names)), strict=True))
    except NoFreePorts as exc:
        raise LaunchError(str(exc)) from None


def local_plan(profile: Profile, run_dir: Path, ports: Mapping[str, int | str]) -> LaunchPlan:
    """The plan of a job on this machine, with its command lines: every process inherits the
    launcher's ``CUDA_VISIBLE_DEVICES``; a CUDA job's ranks share the devices it leaves
    visible where there are fewer than ranks."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    num_devices = visible_cuda_devices(visible) if profile.runtime.device == "cuda" else None
    return plan_local(profile, sys.executable, str(run_dir), local_endpoints(profile, ports),
                      visible, num_devices)


def visible_cuda_devices(visible: str | None) -> int | None:
    """How many CUDA devices this machine's processes see: ``CUDA_VISIBLE_DEVICES``'s entries
    where it is set, else the GPUs the NVIDIA driver lists (None: none found, one per rank)."""
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()]) or None
    try:
        return len(list(NVIDIA_GPUS.iterdir())) or None
    except OSError:
        return None


def run_job(profile: Profile, plan: LaunchPlan, executor: Executor, *, resume: bool = False,
            on_snapshot: Callable[[Snapshot], None] | None = None,
            on_start: Callable[[JobRecord], None] | None = None) -> JobResult:
    """Start the job of ``plan`` through ``executor``, follow it to its end and stop every
    process; Ctrl-C (KeyboardInterrupt) and SIGTERM (converted to SystemExit by the caller)
    stop it too, then propagate. ``profile`` is the one its daemons read; ``resume``: the
    executor's run folder is a stopped job's, to go on with."""
    job, ep = executor.job, plan.endpoints
    assert ep is not None, "a plan with command lines"
    run_dir = Path(job.run_dir)
    prepare_run_dir(profile, plan, run_dir, resume)
    job.save()
    env = [p for p in plan.processes if p.kind == "env"]
    try:
        executor.push(plan)
        executor.start(plan.processes)  # at once: the service starts while ranks import torch
        if env:
            wait_for_env(ep.env_url, executor)
        if on_start is not None:
            on_start(job)

        def restart_env(ended: set[int]) -> None:
            executor.start(env)
            wait_for_env(ep.env_url, executor, ended)

        code, last = follow_job(executor, load_job_keys(run_dir / "keys", "operator"),
                                on_snapshot, restart_env if env else None)
    except KeyboardInterrupt:  # Ctrl-C: the coordinator records it and writes the report
        executor.interrupt()
        raise
    finally:
        executor.shut_down(grace_s=5.0)
    report = run_dir / "report.md"
    stop = last_stop(run_dir)
    return JobResult(job.job_id, run_dir, code, report if report.exists() else None, last,
                     stop.get("reason") or "", stop.get("resume") or "")


def follow_job(executor: Executor, keys, on_snapshot: Callable[[Snapshot], None] | None,
               restart_env: Callable[[set[int]], None] | None = None
               ) -> tuple[int, Snapshot | None]:
    """Until the coordinator exits: snapshots to ``on_snapshot``. Once the job is up (the
    coordinator's first snapshot), a rank that dies is the coordinator's to handle (it misses
    heartbeats: the job goes on without it, or stops resumable), and so is a rank
    whose engine server died: the launcher kills the rank too; an environment service that
    dies is started again (``restart_env``, at most ENV_RESTARTS times: the tasks it served
    fail and their groups are counted dropped). Before, a rank, an engine server or the
    environment service that exits ends the job with LaunchError naming the process and its
    log's last line."""
    last: Snapshot | None = None
    handled: set[int] = set()
    env_restarts = 0
    with Subscriber(executor.job.info["pub"], keys) as sub:
        while True:
            msg = sub.recv(0.25)
            if isinstance(msg, Snapshot):
                last = msg
                if on_snapshot is not None:
                    on_snapshot(msg)
            for record, code in executor.exited():
                if record.kind == "coordinator":
                    if code == 0:
                        let_ranks_exit(executor, last)
                    return code, last
                if record.pid in handled:
                    continue
                if record.kind == "engine" and last is not None:
                    handled.add(record.pid)
                    _lose_rank_of(executor, record, code, last)
                elif record.kind == "env" and last is not None and restart_env is not None \
                        and env_restarts < ENV_RESTARTS:
                    handled.add(record.pid)
                    env_restarts += 1
                    log.warning("%s; starting it again (%d of %d)", exit_line(record, code),
                                env_restarts, ENV_RESTARTS)
                    restart_env(handled)
                elif record.kind in ("engine", "env") or (record.kind == "rank" and last is None):
                    raise LaunchError(exit_line(record, code))


def _lose_rank_of(executor: Executor, engine: ProcessRecord, code: int,
                  last: Snapshot) -> None:
    """A rank's engine server died. A rank rolling out on it goes too, and the coordinator
    handles a dead rank (its tasks start again elsewhere); a trainer rank (its server asleep)
    trains on, but cannot roll out again: a move of it to rollout fails that boundary."""
    role = last.roles.get(engine.rank if engine.rank is not None else -1, "")
    if role != "rollout" and executor.job.info.get("system") != "sync":  # sync: all roll out
        log.warning("%s; rank %s (%s) goes on without it", exit_line(engine, code),
                    engine.rank, role or "unknown role")
        return
    log.warning("%s; stopping rank %s with it", exit_line(engine, code), engine.rank)
    for record in executor.job.processes:
        if record.kind == "rank" and record.rank == engine.rank:
            executor.kill(record)


def exit_line(record: ProcessRecord, code: int) -> str:
    """``rank1 exited with code 1: <its log's last line> (see <log>)``."""
    tail = last_log_line(Path(record.log))
    return (f"{record.name} exited with code {code}{': ' + tail if tail else ''} "
            f"(see {record.log})")


def last_log_line(path: Path, limit: int = 200) -> str:
    """The last non-empty line of a log on this machine ("" if there is none here)."""
    try:
        with open(path, "rb") as log:
            log.seek(max(0, log.seek(0, 2) - 8192))
            lines = [line.strip() for line in log.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    line = next((line for line in reversed(lines) if line), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def let_ranks_exit(executor: Executor, last: Snapshot | None) -> None:
    """The ranks got their Shutdown (after the last checkpoint): give them time to finish. A
    rank the coordinator declared dead (idle in the last snapshot: stopped, say) got none and is
    not waited for; it is stopped with the rest."""
    dead = {rank for rank, role in last.roles.items() if role == "idle"} if last else set()
    ranks = {r.pid for r in executor.job.processes if r.kind == "rank" and r.rank not in dead}
    deadline = time.monotonic() + RANK_EXIT_GRACE_S
    while time.monotonic() < deadline:
        done = {r.pid for r, _ in executor.exited()}
        if ranks <= done:
            return
        time.sleep(0.1)
