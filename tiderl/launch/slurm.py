"""A job inside a Slurm allocation (``tiderl launch --slurm``, under ``salloc`` or ``sbatch``).

    1. the allocation, from the environment Slurm gives the launcher: SLURM_JOB_ID, the nodes
       (SLURM_JOB_NODELIST expanded by ``scontrol show hostnames``, each node's address from
       ``scontrol show node``), the GPUs of a node (SLURM_GPUS_ON_NODE, else SLURM_JOB_GPUS);
       made into the nodes of a plan as hosts.yaml's would be (:func:`allocation_hosts`): the
       coordinator on the first node, ranks filling the nodes in order, sharing a node's GPUs
       where there are fewer than its ranks; on the CPU, the ranks split evenly over the nodes
    2. the plan (:func:`tiderl.launch.plan.plan_nodes`), every node's run folder the launcher's
       own: the nodes must share its filesystem, as an sbatch script's working folder is
    3. each node's processes start in one job step (an environment service started again after
       it died: a step of its own), ``srun --nodes 1
       --ntasks 1 --nodelist NODE --overlap`` running ``python -m tiderl.launch.nodectl
       supervise SPEC`` (:mod:`tiderl.launch.nodectl`): it starts them, says their PIDs on one
       line, reports each exit on a line of its own, and takes ``kill`` and ``stop`` commands on
       its stdin. Slurm accounts, confines and cleans up the step as any other; the step ids are
       in job.json (``info.slurm``), so ``tiderl stop`` can ``scancel`` them once the launcher
       is gone.

Everything that cannot work is one line, exit 2, before anything starts: not inside an
allocation, a node list scontrol cannot expand, a CUDA profile in an allocation without GPUs.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tiderl.core.quote import cut, short
from tiderl.launch.hosts import Hosts, Node
from tiderl.launch.local import (
    COORDINATOR_GRACE_S,
    JobRecord,
    LaunchError,
    LaunchRefused,
    ProcessRecord,
    split_coordinator,
)
from tiderl.launch.nodectl import read_model_answer
from tiderl.launch.plan import LaunchPlan, ProcessSpec
from tiderl.models.hub import MODEL_TIMEOUT_S, HubError, Resolved
from tiderl.profile import Profile

if TYPE_CHECKING:  # the job module imports this one's callers
    from tiderl.launch.job import JobResult
    from tiderl.runtime.bus import Snapshot

SCONTROL_TIMEOUT_S = 30.0
STEP_START_S = 120.0  # a step's processes started and their PIDs said (Slurm may queue it)


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]  # node names, in Slurm's order
    addresses: Mapping[str, str]  # node -> the address the others reach it at
    gpus: tuple[int, ...]  # a node's GPU indices (every node's: Slurm allocates alike)


def _scontrol(*args: str) -> str:
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        raise LaunchRefused("--slurm: scontrol is not on PATH (is this a Slurm cluster?)")
    try:
        proc = subprocess.run([scontrol, *args], capture_output=True, text=True,
                              timeout=SCONTROL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LaunchRefused(f"--slurm: scontrol {' '.join(args)} did not answer in "
                            f"{SCONTROL_TIMEOUT_S:.0f} s") from None
    # scontrol says "Invalid hostlist" (and an error line) with exit 0 for a list it cannot parse
    failed = proc.returncode != 0 or "error:" in proc.stderr \
        or proc.stdout.startswith("Invalid hostlist")
    if failed:
        lines = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
        raise ScontrolError(lines[-1] if lines else f"scontrol {cut(' '.join(args))}: exit "
                                                    f"{proc.returncode}")
    return proc.stdout


class ScontrolError(LaunchRefused):
    """What scontrol said, in its own words (one line)."""


def gpu_indices(env: Mapping[str, str]) -> tuple[int, ...]:
    """A node's GPUs in the allocation: SLURM_JOB_GPUS (indices, ``0,1``) or
    SLURM_GPUS_ON_NODE (a count); none when neither is set. LaunchRefused when unreadable."""
    listed = env.get("SLURM_JOB_GPUS", "").strip()
    if listed:
        try:
            return tuple(range(len([int(g) for g in listed.split(",")])))
        except ValueError:
            raise LaunchRefused(f"--slurm: SLURM_JOB_GPUS {short(listed)}: expected GPU "
                                "indices such as 0,1") from None
    count = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if not count:
        return ()
    if not count.isdigit():
        raise LaunchRefused(f"--slurm: SLURM_GPUS_ON_NODE {short(count)}: expected a count")
    return tuple(range(int(count)))


def read_allocation(env: Mapping[str, str] = os.environ) -> Allocation:
    """The allocation the launcher runs in (LaunchRefused, one line, outside one)."""
    job_id = env.get("SLURM_JOB_ID", "").strip()
    nodelist = env.get("SLURM_JOB_NODELIST", "").strip()
    if not job_id or not nodelist:
        raise LaunchRefused("--slurm: not inside a Slurm allocation (SLURM_JOB_ID and "
                            "SLURM_JOB_NODELIST are unset): run it under salloc or sbatch")
    try:
        nodes = tuple(_scontrol("show", "hostnames", nodelist).split())
    except ScontrolError as exc:
        raise LaunchRefused(f"--slurm: SLURM_JOB_NODELIST {short(nodelist)} cannot be "
                            f"expanded: {exc}") from None
    if not nodes:
        raise LaunchRefused(f"--slurm: SLURM_JOB_NODELIST {short(nodelist)} names no node")
    addresses = {}
    for node in nodes:
        try:
            shown = _scontrol("show", "node", "-o", node)
        except ScontrolError as exc:
            raise LaunchRefused(f"--slurm: SLURM_JOB_NODELIST {short(nodelist)}: node "
                                f"{short(node)}: {exc}") from None
        fields = dict(f.split("=", 1) for f in shown.split() if "=" in f)
        addresses[node] = fields.get("NodeAddr") or node
    return Allocation(job_id, nodes, addresses, gpu_indices(env))


def allocation_hosts(alloc: Allocation, profile: Profile, run_root: Path) -> Hosts:
    """The allocation's nodes as the plan's: on CUDA each node's GPUs (LaunchRefused without
    any), on the CPU the ranks split evenly over the nodes; every node's python the launcher's
    and its work folder the run root (a shared filesystem)."""
    num_ranks = profile.runtime.num_ranks
    if profile.runtime.device == "cuda":
        if not alloc.gpus:
            raise LaunchRefused("runtime.device is cuda, but the Slurm allocation has no GPUs "
                                "(SLURM_GPUS_ON_NODE and SLURM_JOB_GPUS are unset): ask for "
                                "--gpus-per-node")
        devices = [alloc.gpus] * len(alloc.nodes)
    else:
        per, extra = divmod(num_ranks, len(alloc.nodes))
        devices = [tuple(range(max(1, per + (i < extra)))) for i in range(len(alloc.nodes))]
    workdir = str(run_root)  # the plan names the run folder itself (plan_nodes)
    nodes = tuple(Node(name=name, host=name, address=alloc.addresses[name], devices=d,
                       python=sys.executable, workdir=workdir)
                  for name, d in zip(alloc.nodes, devices, strict=True))
    return Hosts(nodes=nodes, coordinator=alloc.nodes[0], env_node=None, env_url=None,
                 port_base=None, source="the Slurm allocation")


def resolve_on_node(alloc: Allocation, node: str, path: str, revision: str) -> Resolved:
    """A hub id resolved on ``node``, into its cache, in a job step of its own
    (``nodectl model``); HubError naming the node."""
    argv = ["srun", f"--jobid={alloc.job_id}", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
            "--overlap", "--job-name=tiderl-model", sys.executable, "-m",
            "tiderl.launch.nodectl", "model", path, "--revision", revision]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=MODEL_TIMEOUT_S)
    resolved = read_model_answer(proc.stdout, node)
    if resolved is None:
        last = proc.stderr.strip().splitlines()
        raise HubError(f"node {node}: could not resolve model.path {path}: "
                       f"{last[-1] if last else f'srun exit {proc.returncode}'}")
    return resolved


def srun_command(alloc: Allocation, node: str, spec_file: str, python: str) -> list[str]:
    """The job step that runs ``spec_file``'s processes on ``node``."""
    return ["srun", f"--jobid={alloc.job_id}", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
            "--overlap", "--kill-on-bad-exit=0", "--input=all", "--job-name=tiderl",
            python, "-m", "tiderl.launch.nodectl", "supervise", spec_file]


class _Step:
    """One running ``srun``: its supervisor's lines, read by a thread."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log.open("ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1,
                                     start_new_session=True)
        self.lines: list[dict] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            with self.cond:
                self.lines.append(message)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, wanted: Callable[[dict], bool], timeout_s: float) -> dict | None:
        """The first line ``wanted``: None if the step ended or the time ran out first."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                found = next((m for m in self.lines if wanted(m)), None)
                if found is not None or self.proc.poll() is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(min(left, 0.5))

    def send(self, command: dict) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps(command) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass

    def exits(self) -> dict[int, int]:
        """Exit codes by PID, as the supervisor reported them."""
        with self.cond:
            return {m["pid"]: m["code"] for m in self.lines if "exited" in m}


class SlurmExecutor:
    """What :func:`tiderl.launch.job.run_job` needs of an executor, in job steps."""

    def __init__(self, job: JobRecord, alloc: Allocation) -> None:
        self.job, self.alloc = job, alloc
        self.steps: list[tuple[_Step, list[int]]] = []  # (step, its processes' PIDs)

    def push(self, plan: LaunchPlan) -> None:
        """Nothing to copy: every node reads the launcher's run folder (a shared
        filesystem)."""

    def start(self, specs: Sequence[ProcessSpec]) -> None:
        """One step per node for ``specs``, in order; if one fails to start, stop everything
        started and raise."""
        run_dir = Path(self.job.run_dir)
        for folder in ("slurm", "logs"):
            (run_dir / folder).mkdir(exist_ok=True)
        by_node: dict[str, list[ProcessSpec]] = {}
        for spec in specs:
            by_node.setdefault(spec.host, []).append(spec)
        for node, group in by_node.items():
            name = f"{group[0].name}-{node}"
            spec_file = run_dir / "slurm" / f"{name}.json"
            spec_file.write_text(json.dumps({"processes": [
                {"name": s.name, "argv": list(s.argv), "env": s.env,
                 "log": str(Path(s.run_dir) / "logs" / f"{s.name}.log")} for s in group]}))
            step = _Step(srun_command(self.alloc, node, str(spec_file), sys.executable),
                         run_dir / "logs" / f"srun-{name}.log")
            started = step.wait_for(lambda m: "started" in m, STEP_START_S)
            if started is None:
                if step.proc.poll() is None:  # queued or hung: it goes, with what it started
                    step.proc.kill()
                    step.proc.wait()
                self.stop(grace_s=2.0)
                raise LaunchError(f"node {node}: the job step did not start its processes "
                                  f"(see {run_dir}/logs/srun-{name}.log)")
            self.steps.append((step, [started["started"][s.name] for s in group]))
            slurm = self.job.info.setdefault("slurm", {"job_id": self.alloc.job_id,
                                                       "steps": {}})
            slurm["steps"][f"{self.alloc.job_id}.{started['step']}"] = [s.name for s in group]
            for s in group:
                self.job.processes.append(ProcessRecord(
                    name=s.name, kind=s.kind, pid=started["started"][s.name],
                    log=str(Path(s.run_dir) / "logs" / f"{s.name}.log"), argv=list(s.argv),
                    rank=s.rank, host=node))
            self.job.save()

    def exited(self) -> list[tuple[ProcessRecord, int]]:
        """The processes whose exit their step reported (by PID: an environment service
        started again has a new one); a step's others with code 1 once the step has ended."""
        codes: dict[int, int] = {}
        for step, pids in self.steps:
            reported = step.exits()
            codes.update(reported)
            if step.proc.poll() is not None:
                codes.update({pid: 1 for pid in pids if pid not in reported})
        return [(r, codes[r.pid]) for r in self.job.processes if r.pid in codes]

    def kill(self, record: ProcessRecord) -> None:
        step = next((step for step, pids in self.steps if record.pid in pids), None)
        if step is not None:
            step.send({"kill": record.name})

    def interrupt(self) -> None:
        """Nothing to pass on: :meth:`shut_down` stops the coordinator first, and it records
        the job as stopped and writes its report."""

    def stop(self, grace_s: float = 10.0) -> None:
        """The coordinator first (its grace: it writes the report), then every other process:
        SIGTERM, SIGKILL after ``grace_s``, each by its node's supervisor; then every step's
        supervisor ends, and its step with it."""
        first, rest = split_coordinator(self.job.processes)
        for number, (group, grace) in enumerate(((first, max(grace_s, COORDINATOR_GRACE_S)),
                                                 (rest, grace_s))):
            asked = []
            for step, pids in self.steps:
                mine = [r.name for r in group if r.pid in pids]
                if mine:
                    step.send({"stop": mine, "grace_s": grace, "id": number})
                    asked.append(step)
            for step in asked:  # the supervisor answers once they are gone (or killed)
                step.wait_for(lambda m, n=number: m.get("stopped") == n, grace + 15.0)
        for step, _ in self.steps:
            step.send({"exit": True})
            try:
                step.proc.wait(30.0)
            except subprocess.TimeoutExpired:
                step.proc.kill()
                step.proc.wait()
            step.log.close()

    def shut_down(self, grace_s: float) -> None:
        self.stop(grace_s)


def run_slurm(profile: Profile, *, run_root: Path | None = None, job_id: str | None = None,
              on_snapshot: Callable[[Snapshot], None] | None = None,
              on_start: Callable[[JobRecord], None] | None = None,
              launcher_pid: int | None = None,
              env: Mapping[str, str] = os.environ) -> JobResult:
    """As :func:`tiderl.launch.job.run_local`, in the Slurm allocation the launcher runs in."""
    from tiderl.launch.job import job_info, local_ports, run_job, with_model_resolved
    from tiderl.launch.plan import node_profile, plan_nodes
    from tiderl.launch.run_folders import kept_if_used, new_run_dir

    alloc = read_allocation(env)
    root = run_root or Path(profile.runtime.run_dir)
    hosts = allocation_hosts(alloc, profile, root)
    profile, model = with_model_resolved(profile, {
        node: functools.partial(resolve_on_node, alloc, node) for node in alloc.nodes})
    run_dir = new_run_dir(root, profile.runtime.system, job_id)
    with kept_if_used(run_dir):
        plan = plan_nodes(hosts, profile, run_dir.name, local_ports(profile),
                          run_dir=str(run_dir))
        job = JobRecord(run_dir.name, str(run_dir), time.time(), info=job_info(
            profile, plan.endpoints, launcher_pid=launcher_pid, coordinator_node=alloc.nodes[0],
            slurm={"job_id": alloc.job_id, "nodes": list(alloc.nodes), "steps": {}}, **model))
        return run_job(node_profile(profile, hosts), plan, SlurmExecutor(job, alloc),
                       on_snapshot=on_snapshot, on_start=on_start)


# -- job control of a job in an allocation (tiderl status, stop) ----------------------------------

def is_slurm(job: JobRecord) -> bool:
    return "slurm" in job.info


def running_steps(job: JobRecord) -> set[str]:
    """The job's steps Slurm still runs (``JOB.STEP``): none once the allocation has ended."""
    squeue = shutil.which("squeue")
    if squeue is None:
        raise LaunchError("a Slurm job: squeue is not on PATH here")
    proc = subprocess.run([squeue, "-h", "-s", "-j", job.info["slurm"]["job_id"], "-o", "%i"],
                          capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    return set(proc.stdout.split()) if proc.returncode == 0 else set()


def step_states(job: JobRecord) -> dict[str, str | None]:
    """Each process's state as its step's: "R" while Slurm runs the step, else None (gone)."""
    running = running_steps(job)
    return {name: "R" if step in running else None
            for step, names in job.info["slurm"]["steps"].items() for name in names}


def cancel_steps(job: JobRecord, grace_s: float) -> dict[str, str]:
    """SIGTERM every step of the job still running (its supervisor passes it on to each of
    its processes' groups, Slurm to every task), SIGKILL after ``grace_s``; how each process
    ended, as :func:`tiderl.launch.local.stop_together` says it."""
    steps = job.info["slurm"]["steps"]
    outcome = {name: "gone" for names in steps.values() for name in names}
    running = running_steps(job) & set(steps)
    if not running:
        return outcome
    subprocess.run(["scancel", "--signal=TERM", *sorted(running)], capture_output=True,
                   timeout=SCONTROL_TIMEOUT_S)
    deadline = time.monotonic() + grace_s
    while (left := running_steps(job) & running) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        subprocess.run(["scancel", *sorted(left)], capture_output=True,
                       timeout=SCONTROL_TIMEOUT_S)
        while running_steps(job) & left and time.monotonic() < deadline + 30.0:
            time.sleep(0.2)
    for step in running:
        for name in steps[step]:
            outcome[name] = "killed" if step in left else "terminated"
    return outcome


def dry_run_lines(plan: LaunchPlan, alloc: Allocation) -> list[str]:
    """The srun line of each node's step, as ``--dry-run`` shows them."""
    nodes = list(dict.fromkeys(p.host for p in plan.processes))
    return [" ".join(srun_command(alloc, node, f"<run>/slurm/<phase>-{node}.json",
                                  sys.executable)) for node in nodes]
