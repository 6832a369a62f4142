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
FLOOR = 1024  # where a range reaching below LOWEST leaves too few, the search goes down to here


class NoFreePorts(OSError):
    """Fewer free ports than asked for; the message says why."""


def ephemeral_range() -> tuple[int, int]:
    """This machine's ephemeral range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def listen_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free to listen on at ``host`` (an address or a name) now, in
    random order (two callers at once rarely pick the same): outside the ephemeral range, from
    10000 up, then from 1024 up; from the ephemeral range itself (``bind(0)``) only where the
    rest has too few, as a machine whose range starts low leaves."""
    if count <= 0:
        return []
    if count > 65536 - FLOOR:
        raise NoFreePorts(f"no {count} free ports to listen on: there are {65536 - FLOOR} "
                          f"from {FLOOR} up")
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as exc:
        raise NoFreePorts(f"no ports to listen on at {host}: it does not resolve ({exc})") \
            from None
    low, high = ephemeral_range()
    shuffle = random.SystemRandom().shuffle  # not the process's seeded stream: forks share it
    upper = [p for p in range(LOWEST, 65536) if not low <= p <= high]
    lower = [p for p in range(FLOOR, LOWEST) if not low <= p <= high]
    shuffle(upper)
    shuffle(lower)
    found: list[int] = []
    for port in [*upper, *lower]:
        if _is_free(family, address, port):
            found.append(port)
            if len(found) == count:
                return found
    while len(found) < count:  # the ephemeral range: the kernel's pick
        port = _is_free(family, address, 0)
        if not port or port in found:
            break
        found.append(port)
    if len(found) == count:
        return found
    raise NoFreePorts(f"no {count} free ports to listen on at {host} (found {len(found)})")


def _is_free(family: int, address: tuple, port: int) -> int:
    """The port, bound and released at once (the kernel's pick for 0); 0 when it is taken."""
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address[0], port, *address[2:]))
        except OSError:
            return 0
        return sock.getsockname()[1]


def free_port(host: str = "127.0.0.1") -> int:
    return listen_ports(1, host)[0]
