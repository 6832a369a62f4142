"""Ports to listen on, picked outside the kernel's ephemeral range.

An outgoing connection takes its local port from ``/proc/sys/net/ipv4/ip_local_port_range``. A
port picked there (``bind(0)``, the usual trick) can be handed to any process's next connection
(a health poll, a gloo peer link, another test's client) between the pick and the bind of the
server it is for, which then fails with EADDRINUSE. A port outside that range is only ever taken
by another listener. Used by the launcher for every daemon of a job, by ``tiderl.launch.nodectl
ports`` on a remote node, and by the multi-process helpers and tests.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below it sit the well-known and registered services people run


class NoFreePorts(OSError):
    """Fewer free ports than asked for outside the ephemeral range; the message says how many."""


def ephemeral_range() -> tuple[int, int]:
    """This machine's ephemeral range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def listen_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free to listen on at ``host`` now, outside the ephemeral range,
    in random order (two callers at once rarely pick the same)."""
    low, high = ephemeral_range()
    candidates = [p for p in range(LOWEST, 65536) if not low <= p <= high]
    random.shuffle(candidates)
    found: list[int] = []
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise NoFreePorts(f"no {count} free ports to listen on at {host} outside {low}-{high} "
                      f"(found {len(found)})")


def free_port(host: str = "127.0.0.1") -> int:
    return listen_ports(1, host)[0]
