"""The bounds on the connections of an HTTP server of TideRL (the environment service's
``env.connections``, the engine server's ``engine.connections``): how long a request may take
to arrive, and how many connections one client address may hold open. Enforced by
:mod:`tiderl.serving.uvicorn_server`; this module is the config alone (no uvicorn import)."""

from __future__ import annotations

from dataclasses import dataclass

from tiderl.core.config import require_positive


@dataclass(frozen=True)
class ConnectionLimits:
    # a request's headers complete within this many seconds of its first byte (of the
    # connection's opening, for its first request); past it: 408 and the connection closed
    header_timeout_s: float = 10.0
    # its body, within this many seconds of the headers' end; past it: 408 and closed
    body_timeout_s: float = 30.0
    # connections one client address holds open; a request on one more is answered 503 and
    # that connection closed. A node's ranks share one address: this is their sum's bound.
    max_per_client: int = 256

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "body_timeout_s", "max_per_client"):
            require_positive(getattr(self, name), name)
