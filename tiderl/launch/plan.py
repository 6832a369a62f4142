"""The launch plan: profile (+ hosts.yaml) -> the processes a job runs, with their command lines.
Pure (no I/O), so it can be printed (``tiderl launch --dry-run``), tested and executed by the
local or the SSH executor.

    env service (unless env.url or runtime.replay is set)   engine 0 .. N-1   coordinator
    rank 0 .. rank N-1

Each rank has one device. With a server engine backend (``engine.backend``: http, vllm, sglang)
and no ``engine.urls``, each rank also gets an engine server on its node and device, bound to
the loopback (``engineN``): the rank serves rollout through it and keeps it asleep while it is
not a rollout rank (ERS may move any rank, so every rank has one). Our own server (``http``:
``tiderl engine serve``) reads the run folder's profile, as every daemon does; vLLM and SGLang
servers get the engine settings as their flags.

Initial roles: under system ``sync`` every rank is one colocated set (it rolls out, then
trains). In the other systems ranks ``0..rollout_ranks-1`` start as rollout and the rest as
trainer ranks: all actor (Ref colocated) unless RA2P is pinned to ``decoupled``, which needs a
dedicated ref rank. ERS may move ranks from the first post-update boundary on.

On nodes (:func:`plan_nodes`) ranks fill the nodes of hosts.yaml in order, one per device; the
coordinator and the environment service run where hosts.yaml says. With fewer devices than ranks
(on nodes, or the visible GPUs of this machine) consecutive ranks share a device
(:func:`share_devices`). Ranks that share a CUDA device cannot be one NCCL communicator: every
rank then joins the world over gloo (which all-reduces and broadcasts CUDA tensors through host
memory: DDP's gradient reduction and its parameter broadcast; FSDP2's and megatron's all-gather
and reduce-scatter it does not have, so those backends are refused), and each process of the
device caps its memory at its share (:func:`memory_shares`). Every daemon reads the run
folder ``<workdir>/runs/<job>/`` of its node (the launcher pushes the profile and the keys there).

HTTP tokens: the environment service, our engine servers (backend ``http``) and the ranks get
``TIDERL_JOB_KEYS=<run folder>/keys``, from which each derives the job's tokens
(:mod:`tiderl.auth`): the servers require them, the ranks' clients send them. Only the folder's
path is in the plan (and on an SSH command line), never a token.
"""

from __future__ import annotations

import posixpath
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from tiderl.auth import JOB_KEYS_VAR
from tiderl.core.step_control import initial_roles as launch_roles
from tiderl.core.system import SystemSpec
from tiderl.core.types import Role
from tiderl.engine.config import SERVED_MODEL_NAME
from tiderl.launch.hosts import PORT_NAMES, Hosts, HostsError, Node
from tiderl.models.config import context_length
from tiderl.profile import Profile
from tiderl.runtime.affinity import SPREAD

LOCAL_HOST = "localhost"
CPU_BLOCK_MULTIPLE = 32  # vLLM 0.34's CPU attention takes blocks of a multiple of 32 tokens
T = TypeVar("T")
RUN_PROFILE = "profile.yaml"  # the resolved profile in a run folder, which every daemon reads


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    kind: str  # "env" | "engine" | "coordinator" | "rank"
    host: str = LOCAL_HOST  # the node's name in hosts.yaml
    rank: int | None = None
    role: Role | None = None
    device: str | None = None
    threads: int | None = None
    cpu_slot: tuple[int, int] | None = None  # (i, n): pinned to the i-th of n core sets
    share: int = 1  # ranks on this process's device (a rank, an engine server)
    argv: tuple[str, ...] = ()  # empty until the endpoints are known
    engine_url: str = ""  # a rank's engine server
    env: dict[str, str] = field(default_factory=dict)  # added to the node's environment
    run_dir: str = ""


@dataclass(frozen=True)
class Endpoints:
    """Where the daemons meet: the coordinator's address (it binds there, the others connect),
    the environment service's URL, rank 0's address (the gloo rendezvous) and the ports."""

    coordinator: str
    env_url: str
    dist_host: str
    ports: Mapping[str, int | str]  # bus, pub, metrics, env, dist (str: a placeholder)

    @property
    def bus(self) -> str:
        return f"tcp://{self.coordinator}:{self.ports['bus']}"

    @property
    def pub(self) -> str:
        return f"tcp://{self.coordinator}:{self.ports['pub']}"

    @property
    def metrics(self) -> str:
        return f"http://{self.coordinator}:{self.ports['metrics']}/metrics"


@dataclass(frozen=True)
class LaunchPlan:
    processes: tuple[ProcessSpec, ...]
    endpoints: Endpoints | None = None  # None: a plan without command lines

    @property
    def ranks(self) -> tuple[ProcessSpec, ...]:
        return tuple(p for p in self.processes if p.kind == "rank")

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.host for p in self.processes))


def profile_roles(profile: Profile) -> list[Role]:
    """The launch layout, by the core's rule (the simulator lays its GPUs out the same way). A
    replay's rollout ranks start idle (no engine): its steps' layouts are its recording's."""
    rt = profile.runtime
    system = SystemSpec.named(rt.system)
    roles = launch_roles(system, rt.num_ranks, rt.rollout_ranks, profile.ra2p.placement)
    if rt.replay and not system.is_sync:  # under sync every rank trains: it stays one
        return [Role.IDLE if role is Role.ROLLOUT else role for role in roles]
    return roles


def engine_port_names(profile: Profile) -> list[str]:
    """The ports of the engine servers the launcher starts (none with ``engine.urls``)."""
    engine = profile.engine
    if not engine.uses_server or engine.urls:
        return []
    return [f"engine{r}" for r in range(profile.runtime.num_ranks)]


def port_names(profile: Profile) -> tuple[str, ...]:
    """Every port a job's processes listen on: hosts.yaml's ``PORT_NAMES``, then its engine
    servers'."""
    return (*PORT_NAMES, *engine_port_names(profile))


def numbered_ports(profile: Profile, base: int | None) -> dict[str, int | str]:
    """``base``, ``base + 1``, ... in the order of :func:`port_names` (hosts.yaml's
    ``ports.base``); without a base, ``<name-port>`` placeholders for the ports a launch picks
    (what ``--dry-run`` prints)."""
    if base is None:
        return {name: f"<{name}-port>" for name in port_names(profile)}
    return {name: base + i for i, name in enumerate(port_names(profile))}


def engine_url(profile: Profile, rank: int, ep: Endpoints) -> str:
    """Where rank ``rank`` reaches its engine server ("" with the embedded engine)."""
    engine = profile.engine
    if not engine.uses_server:
        return ""
    if engine.urls:
        return engine.urls[rank].rstrip("/")
    return f"http://127.0.0.1:{ep.ports[f'engine{rank}']}"


def engine_command(profile: Profile, python: str, run_dir: str, port: int | str, device: str,
                   visible: str | None = None, share: int = 1
                   ) -> tuple[tuple[str, ...], dict[str, str]]:
    """The command line and added environment of one engine server on the loopback, on the
    rank's device (``cuda:i``: the i-th of the ``visible`` devices the node's processes
    inherit, ``CUDA_VISIBLE_DEVICES``, as for the rank; ``share`` ranks on it: the server takes
    its share of ``engine.gpu_memory_utilization``, :func:`memory_shares`). Our own server reads
    the model and engine sections of the run folder's profile, as every daemon of the job
    does."""
    e, m = profile.engine, profile.model
    util = f"{memory_shares(profile, share)[1]:.4g}"
    if e.backend == "http":
        argv = (python, "-m", "tiderl.cli.main", "engine", "serve",
                "--profile", posixpath.join(run_dir, RUN_PROFILE), "--host", "127.0.0.1",
                "--port", str(port), "--device", device, *e.server_args)
        return argv, {"OMP_NUM_THREADS": str(profile.runtime.threads_per_rank)}
    index = device.removeprefix("cuda:")
    common = ("--host", "127.0.0.1", "--port", str(port), "--served-model-name",
              SERVED_MODEL_NAME, "--dtype", m.dtype)
    if e.backend == "vllm":  # vllm 0.34: vllm/engine/arg_utils.py, entrypoints/cli/serve.py
        return _vllm_command(profile, python, common, index, device, visible, util)
    if e.backend == "sglang":  # sglang 0.5.23: srt/arg_groups/fields/*.py
        argv = (e.server_python or python, "-m", "sglang.launch_server", "--model-path", m.path,
                *common,
                "--random-seed", str(m.seed), "--max-running-requests", str(e.max_num_seqs),
                "--enable-metrics", "--enable-memory-saver",
                "--enable-priority-scheduling", "--schedule-low-priority-values-first",
                "--default-priority-value", "0",
                *(() if e.enable_prefix_caching else ("--disable-radix-cache",)),
                "--mem-fraction-static", util,
                "--base-gpu-id", index, *e.server_args)  # of the inherited visible devices
        return argv, {}
    raise ValueError(f"engine.backend {e.backend!r}: no server command line")


def _vllm_command(profile: Profile, python: str, common: tuple[str, ...], index: str,
                  device: str, visible: str | None, util: str
                  ) -> tuple[tuple[str, ...], dict[str, str]]:
    """``vllm serve`` beside ``engine.server_python`` (else beside the node's python). On a
    GPU it sizes its KV cache in ``gpu_memory_utilization`` and sleeps (``--enable-sleep-mode``);
    on the CPU (vLLM's CPU backend) its pool is ``engine.kv_cache_tokens`` rounded up to whole
    blocks of ``engine.block_size`` rounded up to a multiple of 32, and it has no sleep mode
    (the flag stops its start there; its ``/sleep`` answers and frees nothing)."""
    e, m = profile.engine, profile.model
    vllm = posixpath.join(posixpath.dirname(e.server_python or python), "vllm")
    on_cpu = device == "cpu"
    memory = (_vllm_cpu_pool(profile) if on_cpu else
              ("--enable-sleep-mode", "--gpu-memory-utilization", util))
    argv = (vllm, "serve", m.path, *common, "--seed", str(m.seed),
            "--max-num-seqs", str(e.max_num_seqs),
            "--max-num-batched-tokens", str(e.max_num_batched_tokens),
            "--enable-prefix-caching" if e.enable_prefix_caching else "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details", "--scheduling-policy", "priority", *memory,
            *(("--kv-offloading-size", str(e.host_kv_gib)) if e.host_kv_gib else ()),
            *e.server_args)
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # sleep, reload, reset routes
    if on_cpu:  # its threads unbound: the ranks and servers of a node share its cores
        return argv, env | {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                            "OMP_NUM_THREADS": str(profile.runtime.threads_per_rank)}
    mask = visible.split(",") if visible else []
    physical = mask[int(index)] if index.isdigit() and int(index) < len(mask) else index
    return argv, env | {"CUDA_VISIBLE_DEVICES": physical}  # vLLM takes the device from it


def _vllm_cpu_pool(profile: Profile) -> tuple[str, ...]:
    """A CPU server's KV flags. Without an explicit size it reserves a share of all memory; the
    pool itself is the block override, whatever that size. One block of it is vLLM's null
    block, and it refuses to start unless one sequence of the model's context fits in the
    rest."""
    e = profile.engine
    block = -(-e.block_size // CPU_BLOCK_MULTIPLE) * CPU_BLOCK_MULTIPLE
    blocks = -(-e.kv_cache_tokens // block)
    longest = (blocks - 1) * block
    context = context_length(profile.model.path)
    return ("--block-size", str(block), "--num-gpu-blocks-override", str(blocks),
            "--kv-cache-memory-bytes", str(2**30), "--max-model-len",
            str(min(longest, context) if context else longest))


def share_devices(num_ranks: int, slots: Sequence[T]) -> list[T]:
    """Each rank's device slot, by rank: one each while there are enough; with more ranks than
    slots, consecutive ranks share one, the first ``num_ranks % len(slots)`` slots taking one
    more."""
    per, extra = divmod(num_ranks, len(slots))
    shared = [slot for i, slot in enumerate(slots) for _ in range(per + (i < extra))]
    return shared[:num_ranks] if per else list(slots[:num_ranks])


def _with_shares(ranks: list[ProcessSpec]) -> list[ProcessSpec]:
    """``ranks`` with the count of ranks on each one's device (its node's, its index)."""
    count = Counter((r.host, r.device) for r in ranks if r.device != "cpu")
    return [replace(r, share=count.get((r.host, r.device), 1)) for r in ranks]


def shares_devices(processes: Sequence[ProcessSpec]) -> bool:
    """Whether two ranks of a CUDA job share a device (the world then joins over gloo)."""
    return any(p.share > 1 and p.kind == "rank" for p in processes)


def memory_shares(profile: Profile, share: int) -> tuple[float, float]:
    """(a rank process's cap, an engine server's utilisation) as fractions of a device that
    ``share`` ranks share: each rank's server gets ``engine.gpu_memory_utilization / share``
    and each rank process the rest over ``share`` (with the embedded engine, which lives in the
    rank, a whole ``1 / share``). One rank on its device: no cap (0), the profile's
    utilisation."""
    util = profile.engine.gpu_memory_utilization
    if share <= 1:
        return 0.0, util
    if not profile.engine.uses_server or profile.engine.urls:
        return 1.0 / share, util
    return (1.0 - util) / share, util / share


def check_shared_devices(profile: Profile, processes: Sequence[ProcessSpec]) -> None:
    """Ranks sharing a CUDA device train over gloo: refused for a trainer backend that needs
    collectives gloo has not got for CUDA tensors (one line naming the key)."""
    if shares_devices(processes) and profile.trainer.backend != "ddp":
        most = max(p.share for p in processes)
        raise SharedDeviceError(
            f"trainer.backend {profile.trainer.backend}: {most} ranks share a device, so the "
            "trainer joins over gloo, which has no all-gather or reduce-scatter of CUDA "
            "tensors; use trainer.backend ddp or one rank per device")


class SharedDeviceError(HostsError):
    """A job whose ranks share a device cannot train as asked: a layout error, as hosts.yaml's
    (the CLI prints its one line, exit 2, before anything starts)."""


def daemon_command(spec: ProcessSpec, python: str, run_dir: str, ep: Endpoints,
                   profile: Profile, gloo: bool) -> tuple[str, ...]:
    """``python -m tiderl.runtime <daemon> ...`` of one process (see tiderl/runtime/__main__)."""
    head = (python, "-m", "tiderl.runtime", spec.kind, "--run-dir", run_dir)
    ports = {k: str(v) for k, v in ep.ports.items()}
    if spec.kind == "env":
        host = ep.env_url.split("//", 1)[1].rsplit(":", 1)[0]
        return (*head, "--host", host, "--port", ports["env"])
    if spec.kind == "coordinator":
        return (*head, "--port", ports["bus"], "--pub-port", ports["pub"],
                "--metrics-port", ports["metrics"], "--env-url", ep.env_url)
    pin = ("--cpu-slot", f"{spec.cpu_slot[0]}/{spec.cpu_slot[1]}") if spec.cpu_slot else ()
    engine = ("--engine-url", spec.engine_url) if spec.engine_url else ()
    shared = ("--dist-backend", "gloo") if gloo else ()
    if spec.share > 1:
        shared = (*shared, "--memory-fraction", f"{memory_shares(profile, spec.share)[0]:.4g}")
    return (*head, "--rank", str(spec.rank), "--bus", ep.bus,
            "--dist", f"tcp://{ep.dist_host}:{ports['dist']}", "--env-url", ep.env_url,
            "--device", spec.device or "cpu", "--threads", str(spec.threads or 1), *pin,
            *engine, *shared)


def _cpu_slots(profile: Profile, rank_hosts: list[str]) -> list[tuple[int, int] | None]:
    """Each rank's core-set slot on its node under ``runtime.cpu_affinity`` (None: unpinned):
    ``spread`` numbers the ranks of each node 0..n-1 (tiderl/runtime/affinity.py)."""
    if profile.runtime.cpu_affinity != SPREAD:
        return [None] * len(rank_hosts)
    slots = []
    for i, host in enumerate(rank_hosts):
        slots.append((rank_hosts[:i].count(host), rank_hosts.count(host)))
    return slots


def _rank_env(spec: ProcessSpec) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(spec.threads or 1)} if spec.kind == "rank" else {}


def _token_env(spec: ProcessSpec, profile: Profile, run_dir: str) -> dict[str, str]:
    """Where the job's HTTP tokens come from (see the module docstring), for the processes that
    serve or send them."""
    uses = spec.kind in ("env", "rank", "coordinator") or (spec.kind == "engine"
                                            and profile.engine.backend == "http")
    return {JOB_KEYS_VAR: posixpath.join(run_dir, "keys")} if uses else {}


def plan_local(profile: Profile, python: str | None = None, run_dir: str | None = None,
               ep: Endpoints | None = None, visible_devices: str | None = None,
               num_devices: int | None = None) -> LaunchPlan:
    """Every process on this machine; on GPU profiles rank r gets ``cuda:i`` of this machine's
    ``num_devices`` (None: one per rank), shared by consecutive ranks where there are fewer
    (:func:`share_devices`), else CPU threads. With ``python``, ``run_dir`` and ``ep``, each
    process carries its command line (``visible_devices``: the launcher's
    ``CUDA_VISIBLE_DEVICES``, which every process inherits)."""
    rt = profile.runtime
    needs_env = not (profile.env.url or rt.replay)  # a replay runs no episode
    env = [ProcessSpec(name="env", kind="env")] if needs_env else []
    slots = _cpu_slots(profile, [LOCAL_HOST] * rt.num_ranks)
    devices = share_devices(rt.num_ranks, range(num_devices or rt.num_ranks))
    ranks = []
    for rank, role in enumerate(profile_roles(profile)):
        device = f"cuda:{devices[rank]}" if rt.device == "cuda" else "cpu"
        threads = rt.threads_per_rank if rt.device == "cpu" else None
        ranks.append(ProcessSpec(name=f"rank{rank}", kind="rank", rank=rank, role=role,
                                 device=device, threads=threads, cpu_slot=slots[rank]))
    ranks = _with_shares(ranks)
    processes = [*env, *_engines(profile, ranks),
                 ProcessSpec(name="coordinator", kind="coordinator"), *ranks]
    check_shared_devices(profile, processes)
    if python is None or run_dir is None or ep is None:
        return LaunchPlan(processes=tuple(processes))
    gloo = shares_devices(processes)
    return LaunchPlan(tuple(_command(p, profile, python, run_dir, ep, {}, visible_devices, gloo)
                            for p in processes), ep)


def _engines(profile: Profile, ranks: list[ProcessSpec]) -> list[ProcessSpec]:
    """One engine server per rank, on its node and device (none with ``engine.urls``)."""
    if not engine_port_names(profile):
        return []
    return [ProcessSpec(name=f"engine{r.rank}", kind="engine", host=r.host, rank=r.rank,
                        device=r.device, share=r.share) for r in ranks]


def _command(spec: ProcessSpec, profile: Profile, python: str, run_dir: str, ep: Endpoints,
             node_env: Mapping[str, str], visible: str | None, gloo: bool) -> ProcessSpec:
    """``spec`` with its command line and environment (``visible``: the node's inherited
    ``CUDA_VISIBLE_DEVICES``; ``gloo``: ranks share devices, the world joins over gloo)."""
    if spec.kind == "engine":
        argv, env = engine_command(profile, python, run_dir, ep.ports[spec.name],
                                   spec.device or "cpu", visible, spec.share)
        return replace(spec, argv=argv, env={**node_env, **env,
                                             **_token_env(spec, profile, run_dir)},
                       run_dir=run_dir)
    if spec.kind == "rank":
        spec = replace(spec, engine_url=engine_url(profile, spec.rank or 0, ep))
    return replace(spec, argv=daemon_command(spec, python, run_dir, ep, profile, gloo),
                   env={**node_env, **_rank_env(spec), **_token_env(spec, profile, run_dir)},
                   run_dir=run_dir)


def node_run_dir(workdir: str, job_id: str) -> str:
    return posixpath.join(workdir, "runs", job_id)


def env_service(hosts: Hosts, profile: Profile) -> tuple[str | None, str | None]:
    """(the node to start the environment service on, or None; the URL of a running one, or
    None): hosts.yaml's env.url or env.node, else the profile's env.url, else the coordinator's
    node."""
    if hosts.env_url:
        return None, hosts.env_url
    if hosts.env_node is not None:
        return hosts.env_node, None
    if profile.env.url:
        return None, profile.env.url.rstrip("/")
    return hosts.coordinator, None


def node_endpoints(hosts: Hosts, profile: Profile, plan_ranks: list[str],
                   ports: Mapping[str, int | str]) -> Endpoints:
    env_node, env_url = env_service(hosts, profile)
    if env_node is not None:
        env_url = f"http://{hosts.node(env_node).reach}:{ports['env']}"
    coordinator = hosts.node(hosts.coordinator).reach
    return Endpoints(coordinator, env_url or "", hosts.node(plan_ranks[0]).reach, ports)


def node_profile(profile: Profile, hosts: Hosts) -> Profile:
    """The profile the nodes run: the coordinator binds its bus at its node's address."""
    return replace(profile, runtime=replace(profile.runtime,
                                            bus_host=hosts.node(hosts.coordinator).reach))


def _rank_slots(hosts: Hosts, profile: Profile) -> list[tuple[Node, int]]:
    """Each rank's (node, device index): the nodes of hosts.yaml filled in order, one rank per
    device, consecutive ranks sharing a device where there are more ranks than devices."""
    slots = [(node, index) for node in hosts.nodes for index in node.devices]
    return share_devices(profile.runtime.num_ranks, slots)


def rank_nodes(hosts: Hosts, profile: Profile) -> list[str]:
    """The node of each rank, by rank."""
    return [node.name for node, _ in _rank_slots(hosts, profile)]


def job_nodes(hosts: Hosts, profile: Profile) -> list[str]:
    """Every node a job runs a process on (the launcher opens a session to each before it
    plans the job): the environment service's, the coordinator's, the ranks'."""
    env_node = env_service(hosts, profile)[0]
    named = [env_node] if env_node is not None else []
    return list(dict.fromkeys([*named, hosts.coordinator, *rank_nodes(hosts, profile)]))


def plan_nodes(hosts: Hosts, profile: Profile, job_id: str,
               ports: Mapping[str, int | str], run_dir: str | None = None) -> LaunchPlan:
    """hosts.yaml + profile -> every process with its node, device and command line (each
    node's run folder in its workdir; ``run_dir``: one folder every node shares)."""
    rt = profile.runtime
    slots = _rank_slots(hosts, profile)
    nodes_of_ranks = [node.name for node, _ in slots]
    ep = node_endpoints(hosts, profile, nodes_of_ranks, ports)
    env_node = env_service(hosts, profile)[0]
    env = [] if env_node is None else [ProcessSpec(name="env", kind="env", host=env_node)]
    cpu_slots = _cpu_slots(profile, nodes_of_ranks)
    ranks = []
    for rank, role in enumerate(profile_roles(profile)):
        node, index = slots[rank]
        cuda = rt.device == "cuda"
        ranks.append(ProcessSpec(name=f"rank{rank}", kind="rank", host=node.name, rank=rank,
                                 role=role, device=f"cuda:{index}" if cuda else "cpu",
                                 threads=None if cuda else rt.threads_per_rank,
                                 cpu_slot=cpu_slots[rank]))
    ranks = _with_shares(ranks)
    specs = [*env, *_engines(profile, ranks),
             ProcessSpec(name="coordinator", kind="coordinator", host=hosts.coordinator),
             *ranks]
    check_shared_devices(profile, specs)
    gloo = shares_devices(specs)
    processes = []
    for spec in specs:
        node = hosts.node(spec.host)
        processes.append(_command(spec, profile, node.python,
                                  run_dir or node_run_dir(node.workdir, job_id), ep, node.env,
                                  node.env.get("CUDA_VISIBLE_DEVICES"), gloo))
    return LaunchPlan(tuple(processes), ep)
