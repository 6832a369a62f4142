"""Errors the CLI turns into one line on stderr and an exit code (2: bad usage or profile,
1: a runtime failure or a command that is not built yet), and the checks that raise them
before a command starts anything."""

from __future__ import annotations

EXIT_FAILURE = 1
EXIT_USAGE = 2


class CLIError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_FAILURE):
        super().__init__(message)
        self.exit_code = exit_code


def check_port_free(command: str, host: str, port: int) -> None:
    """CLIError (exit 2) unless a server can listen on ``host:port`` now. A server command calls
    it before it imports torch or loads a model, so a port in use fails at once in one line
    instead of in uvicorn after the load. It binds the way uvicorn's asyncio server does (each
    address of ``host``, SO_REUSEADDR, IPv6 sockets v6-only) and lets go; a process that takes
    the port in between still makes the server fail as before."""
    import errno
    import socket

    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CLIError(f"{command}: --host {host}: {exc.strerror}", EXIT_USAGE) from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                why = {errno.EADDRINUSE: "in use (another server? choose one with --port)",
                       errno.EACCES: "not allowed (ports below 1024 need root)",
                       errno.EADDRNOTAVAIL: f"not available: {host} is not an address of "
                                            "this machine (--host)"}
                raise CLIError(f"{command}: port {port} on {host}: "
                               f"{why.get(exc.errno, exc.strerror or str(exc))}",
                               EXIT_USAGE) from None
