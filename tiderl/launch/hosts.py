"""``hosts.yaml``: the nodes of a cluster job (``tiderl launch --nodes hosts.yaml``).

::

    defaults:                 # optional: every node's value unless the node sets its own
      user: root
      key_file: ~/.ssh/id_ed25519
      python: /opt/tiderl/.venv/bin/python
      workdir: /srv/tiderl
    nodes:
      - name: n0              # optional (default: host, or host:port when hosts repeat)
        host: 10.0.0.1        # what the launcher's SSH connects to
        port: 22
        address: 10.0.0.1     # what the other nodes reach it at (default: host)
        devices: 2            # this node's devices: a count, or CUDA device indices [0, 1]
        env: {GLOO_SOCKET_IFNAME: eth0}   # extra environment of its daemons
      - host: 10.0.0.2
        devices: 2
    coordinator: n0           # the node of the coordinator (default: the first)
    env:                      # the environment service: one of
      node: n1                #   start one on this node
      # url: http://10.0.0.9:8100   # or use a running one
                              # neither: the profile's env.url, else one on the coordinator's node
    ports:                    # optional; default: free ports probed on each node at launch
      base: 29400             #   bus, pub, metrics, env, dist = base .. base+4

Ranks fill the nodes in order (node 0's devices first), one per device; with more ranks than
devices, consecutive ranks share a device (:func:`tiderl.launch.plan.share_devices`). Every
error is one line naming the key.
Loading is pure (text in, value out); ``load_hosts`` only reads the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tiderl.core.quote import cut, one_line, short

PORT_NAMES = ("bus", "pub", "metrics", "env", "dist")
NODE_KEYS = ("name", "host", "port", "address", "user", "key_file", "devices", "python",
             "workdir", "env")
DEFAULTS_KEYS = ("port", "user", "key_file", "python", "workdir", "env")
TOP_KEYS = ("defaults", "nodes", "coordinator", "env", "ports")


class HostsError(ValueError):
    """hosts.yaml is missing, unreadable or invalid; the message is one line naming the key."""


@dataclass(frozen=True)
class Node:
    name: str
    host: str
    port: int = 22
    address: str = ""  # as the other nodes reach it; "" = host
    user: str | None = None  # None: the launcher's user (SSH's default)
    key_file: str | None = None  # None: SSH's default keys and agent
    devices: tuple[int, ...] = (0,)  # device indices; one rank each
    python: str = "python3"
    workdir: str = "."
    env: dict[str, str] = field(default_factory=dict)

    @property
    def reach(self) -> str:
        return self.address or self.host

    @property
    def target(self) -> str:
        user = f"{self.user}@" if self.user else ""
        return f"{user}{self.host}:{self.port}"


@dataclass(frozen=True)
class Hosts:
    nodes: tuple[Node, ...]
    coordinator: str  # node name
    env_node: str | None  # start the environment service there (see plan.env_service)
    env_url: str | None
    port_base: int | None  # None: probe free ports at launch
    source: str = "hosts.yaml"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    @property
    def num_devices(self) -> int:
        return sum(len(n.devices) for n in self.nodes)


def load_hosts(path: str | Path) -> Hosts:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise HostsError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise HostsError(f"{path}:{where} not valid YAML") from None
    return parse_hosts(data, str(path))


def parse_hosts(data: Any, source: str = "hosts.yaml") -> Hosts:
    def fail(key: str, why: str) -> HostsError:
        return HostsError(f"{source}: {cut(key)}: {one_line(why)}")

    if not isinstance(data, dict):
        raise HostsError(f"{source}: expected a mapping with 'nodes'")
    _no_unknown(data, TOP_KEYS, "", fail)
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise fail("defaults", "expected a mapping")
    _no_unknown(defaults, DEFAULTS_KEYS, "defaults.", fail)
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise fail("nodes", "expected a non-empty list of nodes")
    hosts_seen = [n.get("host") for n in raw_nodes if isinstance(n, dict)]
    nodes = []
    for i, raw in enumerate(raw_nodes):
        key = f"nodes[{i}]"
        if not isinstance(raw, dict):
            raise fail(key, "expected a mapping with 'host'")
        _no_unknown(raw, NODE_KEYS, f"{key}.", fail)
        nodes.append(_node({**defaults, **raw}, key, hosts_seen, fail))
    names = [n.name for n in nodes]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise fail(f"nodes[{i}].name", f"{short(name)} names two nodes")
    coordinator = data.get("coordinator", names[0])
    if coordinator not in names:
        raise fail("coordinator", f"no node named {short(coordinator)} (nodes: {_listed(names)})")
    env = data.get("env") or {}
    if not isinstance(env, dict):
        raise fail("env", "expected a mapping with 'node' or 'url'")
    _no_unknown(env, ("node", "url"), "env.", fail)
    if "node" in env and "url" in env:
        raise fail("env", "give 'node' (start one) or 'url' (use a running one), not both")
    env_url = env.get("url")
    if env_url is not None and not (isinstance(env_url, str) and env_url.startswith("http")):
        raise fail("env.url", f"expected an http(s) URL, got {short(env_url)}")
    env_node = env.get("node")
    if env_node is not None and env_node not in names:
        raise fail("env.node", f"no node named {short(env_node)} (nodes: {_listed(names)})")
    ports = data.get("ports") or {}
    if not isinstance(ports, dict):
        raise fail("ports", "expected a mapping with 'base'")
    _no_unknown(ports, ("base",), "ports.", fail)
    base = ports.get("base")
    if base is not None and not (_is_int(base) and 1024 <= base <= 65535 - len(PORT_NAMES)):
        raise fail("ports.base", f"expected a port in 1024..{65535 - len(PORT_NAMES)}, "
                                 f"got {short(base)}")
    return Hosts(tuple(nodes), coordinator, env_node, env_url.rstrip("/") if env_url else None,
                 base, source)


def _node(raw: dict, key: str, hosts_seen: list, fail) -> Node:
    host = raw.get("host")
    if not isinstance(host, str) or not host:
        raise fail(f"{key}.host", "expected a host name or address")
    port = raw.get("port", 22)
    if not (_is_int(port) and 1 <= port <= 65535):
        raise fail(f"{key}.port", f"expected a port in 1..65535, got {short(port)}")
    default_name = f"{host}:{port}" if hosts_seen.count(host) > 1 else host
    name = raw.get("name", default_name)
    devices = raw.get("devices", 1)
    if _is_int(devices) and devices >= 1:
        indices = tuple(range(devices))
    elif (isinstance(devices, list) and devices and all(_is_int(d) and d >= 0 for d in devices)
          and len(set(devices)) == len(devices)):
        indices = tuple(devices)
    else:
        raise fail(f"{key}.devices", f"expected a count >= 1 or a list of distinct device "
                                     f"indices, got {short(devices)}")
    strings = {}
    for name_key in ("name", "address", "user", "key_file", "python", "workdir"):
        value = raw.get(name_key)
        if value is not None and (not isinstance(value, str) or not value):
            raise fail(f"{key}.{name_key}", f"expected a non-empty string, got {short(value)}")
        strings[name_key] = value
    env = raw.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and k.isidentifier()
                                            for k in env):
        raise fail(f"{key}.env", "expected a mapping of environment variable names to values")
    return Node(name=name, host=host, port=port, address=strings["address"] or "",
                user=strings["user"], key_file=strings["key_file"], devices=indices,
                python=strings["python"] or "python3", workdir=strings["workdir"] or ".",
                env={k: str(v) for k, v in env.items()})


def _no_unknown(data: dict, known: tuple[str, ...], prefix: str, fail) -> None:
    for key in data:
        if key not in known:
            raise fail(f"{prefix}{key}", f"unknown key (expected one of: {', '.join(known)})")


def _listed(names: list[str]) -> str:
    return ", ".join(cut(name) for name in names)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
