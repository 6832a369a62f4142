"""Run a job on the nodes of hosts.yaml over SSH (``tiderl launch --nodes hosts.yaml``).

    1. open an SSH session to every node the plan uses; check its python and tiderl against
       the launcher's (one line naming the node on any failure; nothing has started yet)
    2. ports: ``ports.base`` of hosts.yaml, or free ports probed on the nodes that bind them
    3. the plan (pure, :func:`tiderl.launch.plan.plan_nodes`); the local run folder as for a
       local job (profile, roles, keys, job.json with the nodes, PIDs and log paths)
    4. push to each node's ``<workdir>/runs/<job>/``: profile.yaml, roles.json and the keys it
       needs (0600 in a 0700 folder, :func:`node_keys`): ``server.public``, the pairs of its own
       ranks, the HTTP secret; ``server.secret`` and every public key to the coordinator's node
       only; ``operator.secret`` (top, rebalance, the follower) stays on the launcher's machine
    5. start the environment service (wait for its /health), the coordinator and the ranks,
       detached (:mod:`tiderl.launch.ssh`); follow the coordinator's PUB snapshots
    6. at the end, or on any failure, Ctrl-C or SIGTERM: stop every process on every node, then
       fetch metrics.jsonl, events.jsonl, the report and the logs into the local run folder.

:class:`SSHExecutor` has the local executor's interface (``start``, ``exited``, ``stop``), so
following a job is one piece of code (:func:`tiderl.launch.job.follow_job`).
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

from tiderl.launch.hosts import PORT_NAMES, Hosts
from tiderl.launch.job import (
    JobResult,
    follow_job,
    job_info,
    last_stop_in,
    new_job_id,
    prepare_run_dir,
    wait_for_env,
)
from tiderl.launch.local import (
    COORDINATOR_GRACE_S,
    JobRecord,
    ProcessRecord,
    records_by_host,
    split_coordinator,
)
from tiderl.launch.plan import (
    LaunchPlan,
    ProcessSpec,
    engine_port_names,
    env_service,
    node_endpoints,
    node_profile,
    plan_nodes,
)
from tiderl.launch.ssh import NodeError, NodeSession, open_sessions
from tiderl.profile import Profile
from tiderl.runtime.bus import Snapshot, load_job_keys
from tiderl.runtime.bus.keys import (
    HTTP_SECRET,
    OPERATOR,
    SERVER_PUBLIC,
    SERVER_SECRET,
    peer_name,
)
from tiderl.runtime.log_backends import ROLLOUTS_DIR, TENSORBOARD_DIR, WANDB_DIR

log = logging.getLogger("tiderl.launch")

POLL_S = 1.0  # how often the launcher reads the processes' states over SSH
RESULT_FILES = ("metrics.jsonl", "events.jsonl", "report.md")
RESULT_FOLDERS = (TENSORBOARD_DIR, WANDB_DIR)  # the coordinator's logging.backends, if listed


class SSHExecutor:
    """Starts, watches and stops a job's processes on its nodes."""

    def __init__(self, job: JobRecord, sessions: dict[str, NodeSession]):
        self.job = job
        self.sessions = sessions
        self._ended: dict[int, int] = {}  # pid -> exit code as far as we can tell
        self._polled = 0.0

    def start(self, specs: Sequence[ProcessSpec]) -> None:
        """Start each process on its node, in order, a node's consecutive ones in one command;
        if one fails, stop everything started and raise."""
        for host, group in itertools.groupby(specs, key=lambda spec: spec.host):
            batch = [(spec, f"{spec.run_dir}/logs/{spec.name}.log") for spec in group]
            try:
                pids = self.sessions[host].start([(spec.argv, spec.env, log)
                                                  for spec, log in batch])
            except NodeError:
                self.stop(grace_s=2.0)
                raise
            for (spec, log), pid in zip(batch, pids, strict=True):
                self.job.processes.append(ProcessRecord(
                    name=spec.name, kind=spec.kind, pid=pid, log=log, argv=list(spec.argv),
                    rank=spec.rank, host=spec.host))
            self.job.save()

    def exited(self) -> list[tuple[ProcessRecord, int]]:
        """The processes that have ended (states read over SSH at most every POLL_S). A
        detached process's exit status is not ours to read: the coordinator counts as 0 when
        its events end with a ``stop`` for "done", any other process as 1."""
        if time.monotonic() - self._polled >= POLL_S:
            self._polled = time.monotonic()
            for host, records in records_by_host(self.job.processes).items():
                states = self.sessions[host].states([r.pid for r in records])
                for record in records:
                    if record.pid not in self._ended and states[record.pid] in (None, "Z", "X"):
                        self._ended[record.pid] = self._exit_code(record)
        return [(r, self._ended[r.pid]) for r in self.job.processes if r.pid in self._ended]

    def _exit_code(self, record: ProcessRecord) -> int:
        if record.kind != "coordinator":
            return 1
        data = self.sessions[record.host].read(f"{record.run_dir}/events.jsonl") or b""
        return 0 if last_stop_in(data.decode(errors="replace")).get("reason") == "done" else 1

    def kill(self, record: ProcessRecord) -> None:
        """SIGKILL one process on its node."""
        self.sessions[record.host].stop([record.pid], 0.0)

    def stop(self, grace_s: float = 10.0) -> dict[str, str]:
        """SIGTERM, then SIGKILL after ``grace_s``, every process on every node (each node's
        last started first); how each ended ("terminated", "killed" or "gone")."""
        return stop_on_nodes(self.job, self.sessions, grace_s)


def stop_on_nodes(state: JobRecord, sessions: dict[str, NodeSession],
                  grace_s: float) -> dict[str, str]:
    """As :func:`tiderl.launch.local.stop_processes`, on the nodes: the coordinator first, then
    every node's others (each node's last started first)."""
    first, rest = split_coordinator(state.processes)
    outcome: dict[str, str] = {}
    for records, grace in ((first, max(grace_s, COORDINATOR_GRACE_S)), (rest, grace_s)):
        for host, on_host in records_by_host(records).items():
            ended = sessions[host].stop([r.pid for r in reversed(on_host)], grace)
            outcome.update({r.name: ended[r.pid] for r in on_host})
    return outcome


def run_ssh(profile: Profile, hosts: Hosts, *, run_root: Path | None = None,
            job_id: str | None = None, on_snapshot: Callable[[Snapshot], None] | None = None,
            on_start: Callable[[JobRecord], None] | None = None,
            launcher_pid: int | None = None) -> JobResult:
    """As :func:`tiderl.launch.job.run_local`, on the nodes of ``hosts``."""
    job_id = job_id or new_job_id(profile)
    draft = plan_nodes(hosts, profile, job_id,  # where, not how
                       dict.fromkeys((*PORT_NAMES, *engine_port_names(profile)), 0))
    used = draft.hosts
    sessions = open_sessions([hosts.node(name) for name in used])
    state: JobRecord | None = None
    executor: SSHExecutor | None = None
    try:
        hosts = _with_workdirs(hosts, {name: s.check() for name, s in sessions.items()})
        for name, session in sessions.items():
            session.node = hosts.node(name)
        ports = _ports(hosts, profile, sessions, [r.host for r in draft.ranks])
        plan = plan_nodes(hosts, profile, job_id, ports)
        run_dir = (run_root or Path(profile.runtime.run_dir)) / job_id
        node_prof = node_profile(profile, hosts)
        prepare_run_dir(node_prof, plan, run_dir)
        ep = node_endpoints(hosts, profile, [r.host for r in plan.ranks], ports)
        nodes = {name: _node_info(hosts, name) for name in used}
        state = JobRecord(job_id, str(run_dir), time.time(), info=job_info(
            profile, ep, launcher_pid=launcher_pid, nodes=nodes,
            coordinator_node=hosts.coordinator))
        state.save()
        _push(plan, hosts, run_dir, sessions)
        executor = SSHExecutor(state, sessions)
        env = [p for p in plan.processes if p.kind == "env"]
        executor.start(list(plan.processes))  # at once, as run_local does
        if env:
            wait_for_env(ep.env_url, executor)
        if on_start is not None:
            on_start(state)

        def restart_env(ended: set[int]) -> None:
            executor.start(env)
            wait_for_env(ep.env_url, executor, ended)

        code, last = follow_job(executor, state, load_job_keys(run_dir / "keys", "operator"),
                                on_snapshot, restart_env if env else None)
    finally:
        _clean_up(executor, state, sessions)
    report = run_dir / "report.md"
    return JobResult(job_id, run_dir, code, report if report.exists() else None, last)


def _clean_up(executor: SSHExecutor | None, state: JobRecord | None,
              sessions: dict[str, NodeSession]) -> None:
    """Stop every process and fetch the results, then close the sessions. A node failing here
    is raised, unless the job is already failing: then it is logged and the first error goes
    on (the launcher's one line names the cause, not a consequence)."""
    errors: list[NodeError] = []
    for step in (lambda: executor.stop(grace_s=5.0) if executor is not None else None,
                 lambda: fetch_results(state, sessions) if state is not None else None):
        try:
            step()
        except NodeError as exc:
            errors.append(exc)
    for session in sessions.values():
        session.close()
    if errors and sys.exc_info()[0] is None:
        raise errors[0]
    for error in errors:
        log.warning("while stopping the job: %s", error)


def _with_workdirs(hosts: Hosts, workdirs: dict[str, str]) -> Hosts:
    nodes = tuple(replace(n, workdir=workdirs.get(n.name, n.workdir)) for n in hosts.nodes)
    return replace(hosts, nodes=nodes)


def _node_info(hosts: Hosts, name: str) -> dict:
    """What job control needs to reach a node again (see ``ssh.job_node``)."""
    fields = asdict(hosts.node(name))
    fields.pop("devices")
    return fields


def _ports(hosts: Hosts, profile: Profile, sessions: dict[str, NodeSession],
           rank_nodes: list[str]) -> dict[str, int]:
    engines = engine_port_names(profile)
    if hosts.port_base is not None:
        return {name: hosts.port_base + i for i, name in enumerate((*PORT_NAMES, *engines))}
    # bind where each is served: bus, pub and metrics on the coordinator's node, the
    # environment service on its node, the gloo rendezvous on rank 0's, each engine server on
    # its rank's; one probe per node, so that no two of a node's ports are the same
    wanted: dict[str, list[str]] = {hosts.coordinator: ["bus", "pub", "metrics"]}
    env_node = env_service(hosts, profile)[0]
    if env_node is not None:
        wanted.setdefault(env_node, []).append("env")
    wanted.setdefault(rank_nodes[0], []).append("dist")
    for name, node in zip(engines, rank_nodes, strict=False):
        wanted.setdefault(node, []).append(name)
    ports = {"env": 0}
    for node, names in wanted.items():
        ports.update(zip(names, sessions[node].free_ports(len(names)), strict=True))
    return ports


def _push(plan: LaunchPlan, hosts: Hosts, run_dir: Path,
          sessions: dict[str, NodeSession]) -> None:
    """The run folder's files each node's daemons read, and the keys of :func:`node_keys`."""
    keys = run_dir / "keys"
    for name in plan.hosts:
        remote = next(p.run_dir for p in plan.processes if p.host == name)
        files = {f"{remote}/{f}": ((run_dir / f).read_bytes(), 0o644)
                 for f in ("profile.yaml", "roles.json")}
        files.update({f"{remote}/keys/{f}": ((keys / f).read_bytes(), 0o600)
                      for f in node_keys(plan, name, hosts.coordinator)})
        sessions[name].push(files, dirs=[remote, f"{remote}/keys", f"{remote}/logs"])


def node_keys(plan: LaunchPlan, node: str, coordinator: str) -> list[str]:
    """The files of the job's keys folder that ``node`` gets: ``server.public``; the pairs of
    its ranks; the HTTP secret where a rank, an engine server or the environment service runs;
    on the coordinator's node ``server.secret`` and every peer's public key. No node gets
    another node's rank secrets, and ``operator.secret`` stays on the launcher's machine."""
    here = [p for p in plan.processes if p.host == node]
    names = [SERVER_PUBLIC]
    for spec in here:
        if spec.kind == "rank" and spec.rank is not None:
            names += [f"{peer_name(spec.rank)}.public", f"{peer_name(spec.rank)}.secret"]
    if any(p.kind in ("rank", "engine", "env", "coordinator") for p in here):
        names.append(HTTP_SECRET)
    if node == coordinator:
        names += [SERVER_SECRET, f"{OPERATOR}.public",
                  *(f"{peer_name(p.rank)}.public" for p in plan.ranks if p.rank is not None)]
    return list(dict.fromkeys(names))


def fetch_results(state: JobRecord, sessions: dict[str, NodeSession]) -> None:
    """The coordinator's files (with its TensorBoard and wandb folders), every process's log
    and every rank's recorded episodes (``rollouts/``), into the local run folder."""
    local = Path(state.run_dir)
    coordinator = next((r for r in state.processes if r.kind == "coordinator"), None)
    if coordinator is not None:
        session = sessions[coordinator.host]
        remote = coordinator.run_dir
        names = [*RESULT_FILES, *(f for f in session.listdir(remote) if f.endswith(".png"))]
        for name in names:
            session.fetch(f"{remote}/{name}", local / name)
        for folder in RESULT_FOLDERS:
            session.fetch_tree(f"{remote}/{folder}", local / folder)
    for record in state.processes:
        session = sessions[record.host]
        session.fetch(record.log, local / "logs" / Path(record.log).name)
        if record.kind == "rank":
            name = f"rank-{record.rank}.jsonl"
            session.fetch(f"{record.run_dir}/{ROLLOUTS_DIR}/{name}", local / ROLLOUTS_DIR / name)
