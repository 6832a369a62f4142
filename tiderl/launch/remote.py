"""Run a job on the nodes of hosts.yaml over SSH (``tiderl launch --nodes hosts.yaml``).

    1. open an SSH session to every node the job uses (:func:`tiderl.launch.plan.job_nodes`,
       from hosts.yaml and the profile); check its python and tiderl against the launcher's
       (one line naming the node on any failure; nothing has started yet)
    2. ports: ``ports.base`` of hosts.yaml, or free ports probed on the nodes that bind them
    3. the plan, once, from those ports (:func:`tiderl.launch.plan.plan_nodes`); then the steps
       every job goes through (:func:`tiderl.launch.job.run_job`): the local run folder as
       for a local job (profile, roles, keys, job.json with the nodes, PIDs and log paths)
    4. push to each node's ``<workdir>/runs/<job>/``: profile.yaml, roles.json and the keys it
       needs (0600 in a 0700 folder, :func:`node_keys`): ``server.public``, the pairs of its own
       ranks, the HTTP secret; ``server.secret`` and every public key to the coordinator's node
       only; ``operator.secret`` (top, rebalance, the follower) stays on the launcher's machine
    5. start the environment service (wait for its /health), the coordinator and the ranks,
       detached (:mod:`tiderl.launch.ssh`); follow the coordinator's PUB snapshots
    6. at the end, or on any failure, Ctrl-C or SIGTERM: stop every process on every node, then
       fetch metrics.jsonl, events.jsonl, the report and the logs into the local run folder.

:class:`SSHExecutor` is what :func:`run_job` needs of an executor, as the local one is.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from tiderl.launch.hosts import Hosts
from tiderl.launch.job import JobResult, job_info, run_job, with_model_resolved
from tiderl.launch.local import (
    COORDINATOR_GRACE_S,
    JobRecord,
    ProcessRecord,
    alive,
    records_by_host,
    split_coordinator,
)
from tiderl.launch.plan import (
    RUN_PROFILE,
    LaunchPlan,
    ProcessSpec,
    engine_port_names,
    env_service,
    job_nodes,
    node_profile,
    numbered_ports,
    plan_nodes,
    rank_nodes,
)
from tiderl.launch.run_folders import kept_if_used, last_stop_in, new_run_dir
from tiderl.launch.ssh import NodeError, NodeSession, open_sessions
from tiderl.profile import Profile
from tiderl.runtime.bus import Snapshot
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
    """Starts, watches and stops a job's processes on its nodes, over sessions its caller
    opened (and closes)."""

    def __init__(self, job: JobRecord, sessions: dict[str, NodeSession]):
        self.job = job
        self.sessions = sessions
        self._ended: dict[int, int] = {}  # pid -> exit code as far as we can tell
        self._polled = 0.0

    def push(self, plan: LaunchPlan) -> None:
        """The run folder's files each node's daemons read, and the keys of :func:`node_keys`."""
        keys = Path(self.job.run_dir) / "keys"
        coordinator = next(p.host for p in plan.processes if p.kind == "coordinator")
        for name in plan.hosts:
            remote = next(p.run_dir for p in plan.processes if p.host == name)
            files = {f"{remote}/{f}": ((Path(self.job.run_dir) / f).read_bytes(), 0o644)
                     for f in (RUN_PROFILE, "roles.json")}
            files.update({f"{remote}/keys/{f}": ((keys / f).read_bytes(), 0o600)
                          for f in node_keys(plan, name, coordinator)})
            self.sessions[name].push(files, dirs=[remote, f"{remote}/keys", f"{remote}/logs"])

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
                    if record.pid not in self._ended and not alive(states[record.pid]):
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

    def interrupt(self) -> None:
        """Nothing to pass on: :meth:`shut_down` stops the coordinator first (SIGTERM), and it
        records the job as stopped and writes its report."""

    def stop(self, grace_s: float = 10.0) -> dict[str, str]:
        """SIGTERM, then SIGKILL after ``grace_s``, every process on every node (each node's
        last started first); how each ended ("terminated", "killed" or "gone")."""
        return stop_on_nodes(self.job, self.sessions, grace_s)

    def shut_down(self, grace_s: float) -> None:
        """Stop every process and fetch the results. A node failing here is raised, unless the
        job is already failing: then it is logged and the first error goes on (the launcher's
        one line names the cause, not a consequence)."""
        errors: list[NodeError] = []
        for step in (lambda: self.stop(grace_s), lambda: fetch_results(self.job, self.sessions)):
            try:
                step()
            except NodeError as exc:
                errors.append(exc)
        if errors and sys.exc_info()[0] is None:
            raise errors[0]
        for error in errors:
            log.warning("while stopping the job: %s", error)


def stop_on_nodes(job: JobRecord, sessions: dict[str, NodeSession],
                  grace_s: float) -> dict[str, str]:
    """As :func:`tiderl.launch.local.stop_processes`, on the nodes: the coordinator first, then
    every node's others (each node's last started first), on all those nodes at once. A
    coordinator that has ended (a job that finished, or that its launcher stopped) has nothing
    left to record: it goes with the others, and its node's stop is one command, not two."""
    first, rest = split_coordinator(job.processes)
    if first and not any(alive(_state_on_node(r, sessions)) for r in first):
        return _stop_each_node(job.processes, sessions, grace_s)
    outcome = _stop_each_node(first, sessions, max(grace_s, COORDINATOR_GRACE_S))
    outcome.update(_stop_each_node(rest, sessions, grace_s))
    return outcome


def _state_on_node(record: ProcessRecord, sessions: dict[str, NodeSession]) -> str | None:
    """The process's state letter, read over SFTP (no command on the node)."""
    return sessions[record.host].states([record.pid])[record.pid]


def _stop_each_node(records: Sequence[ProcessRecord], sessions: dict[str, NodeSession],
                    grace_s: float) -> dict[str, str]:
    """Stop ``records`` on their nodes, a thread per node: each node's stop is a command that
    starts the login shell there and may wait out the grace period, so nodes stopped one after
    the other would add those up. The first node error is raised once every node is done."""
    by_host = records_by_host(records)

    def stop(host: str) -> dict[str, str]:
        on_host = by_host[host]
        ended = sessions[host].stop([r.pid for r in reversed(on_host)], grace_s)
        return {r.name: ended[r.pid] for r in on_host}

    with ThreadPoolExecutor(max(1, len(by_host))) as pool:
        results = [pool.submit(stop, host) for host in by_host]
    outcome: dict[str, str] = {}
    for result in results:
        outcome.update(result.result())
    return outcome


def run_ssh(profile: Profile, hosts: Hosts, *, run_root: Path | None = None,
            job_id: str | None = None, on_snapshot: Callable[[Snapshot], None] | None = None,
            on_start: Callable[[JobRecord], None] | None = None,
            launcher_pid: int | None = None) -> JobResult:
    """As :func:`tiderl.launch.job.run_local`, on the nodes of ``hosts``: open and check a
    session to each node the job uses (before anything is made), make the local run folder (in
    ``run_root``, named ``job_id`` or a new id), pick the ports, plan the job,
    :func:`run_job` it."""
    sessions = open_sessions([hosts.node(name) for name in job_nodes(hosts, profile)])
    try:
        hosts = _with_workdirs(hosts, {name: s.check() for name, s in sessions.items()})
        for name, session in sessions.items():
            session.node = hosts.node(name)
        profile, model = with_model_resolved(profile, {
            name: session.resolve_model for name, session in sessions.items()})
        run_dir = new_run_dir(run_root or Path(profile.runtime.run_dir),
                              profile.runtime.system, job_id)
        with kept_if_used(run_dir):
            plan = plan_nodes(hosts, profile, run_dir.name, _ports(hosts, profile, sessions))
            nodes = {name: _node_info(hosts, name) for name in plan.hosts}
            job = JobRecord(run_dir.name, str(run_dir), time.time(), info=job_info(
                profile, plan.endpoints, launcher_pid=launcher_pid, nodes=nodes,
                coordinator_node=hosts.coordinator, **model))
            return run_job(node_profile(profile, hosts), plan, SSHExecutor(job, sessions),
                           on_snapshot=on_snapshot, on_start=on_start)
    finally:
        for session in sessions.values():
            session.close()


def _with_workdirs(hosts: Hosts, workdirs: dict[str, str]) -> Hosts:
    nodes = tuple(replace(n, workdir=workdirs.get(n.name, n.workdir)) for n in hosts.nodes)
    return replace(hosts, nodes=nodes)


def _node_info(hosts: Hosts, name: str) -> dict:
    """What job control needs to reach a node again (see ``ssh.job_node``)."""
    fields = asdict(hosts.node(name))
    fields.pop("devices")
    return fields


def _ports(hosts: Hosts, profile: Profile,
           sessions: dict[str, NodeSession]) -> dict[str, int | str]:
    if hosts.port_base is not None:
        return numbered_ports(profile, hosts.port_base)
    # bind where each is served: bus, pub and metrics on the coordinator's node, the
    # environment service on its node, the gloo rendezvous on rank 0's, each engine server on
    # its rank's; one probe per node, so that no two of a node's ports are the same
    nodes_of_ranks = rank_nodes(hosts, profile)
    wanted: dict[str, list[str]] = {hosts.coordinator: ["bus", "pub", "metrics"]}
    env_node = env_service(hosts, profile)[0]
    if env_node is not None:
        wanted.setdefault(env_node, []).append("env")
    wanted.setdefault(nodes_of_ranks[0], []).append("dist")
    for name, node in zip(engine_port_names(profile), nodes_of_ranks, strict=False):
        wanted.setdefault(node, []).append(name)
    ports: dict[str, int | str] = {"env": 0}
    for node, names in wanted.items():
        ports.update(zip(names, sessions[node].free_ports(len(names)), strict=True))
    return ports


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


def fetch_results(job: JobRecord, sessions: dict[str, NodeSession]) -> None:
    """The coordinator's files (with its TensorBoard and wandb folders), every process's log
    and every rank's recorded episodes (``rollouts/``), into the local run folder."""
    local = Path(job.run_dir)
    coordinator = next((r for r in job.processes if r.kind == "coordinator"), None)
    if coordinator is not None:
        session = sessions[coordinator.host]
        remote = coordinator.run_dir
        names = [*RESULT_FILES, *(f for f in session.listdir(remote) if f.endswith(".png"))]
        for name in names:
            session.fetch(f"{remote}/{name}", local / name)
        for folder in RESULT_FOLDERS:
            session.fetch_tree(f"{remote}/{folder}", local / folder)
    for record in job.processes:
        session = sessions[record.host]
        session.fetch(record.log, local / "logs" / Path(record.log).name)
        if record.kind == "rank":
            name = f"rank-{record.rank}.jsonl"
            session.fetch(f"{record.run_dir}/{ROLLOUTS_DIR}/{name}", local / ROLLOUTS_DIR / name)
