"""uvicorn as TideRL's HTTP servers run it: with the bounds of :class:`ConnectionLimits` on each
connection, so a client that sends a request slowly (one header line every few seconds, a body
that never ends) or opens connection after connection cannot hold the server's sockets.

    connection_made ── its address already holds max_per_client ──> its request answered 503
          │                                                         (Connection: close)
          └─ header deadline on
    data_received ───── headers complete ──> header deadline off, body deadline on
                   └─── body complete ────> body deadline off (the app answers: no deadline)
    response sent ───── kept alive: uvicorn's timeout_keep_alive runs, no deadline of ours;
                        the next request's first byte turns the header deadline on again
    a deadline passes ─> 408 {"error": {"message", "type": "request_timeout"}} (when no answer
                        has begun), the connection closed

uvicorn's options bound neither: ``timeout_keep_alive`` runs only between requests (a byte of
the next request stops it), ``limit_concurrency`` counts every client together. The protocol is
uvicorn's h11 one with three hooks (connection made, data received, response sent) that read
h11's state of the client's side; it is used even where uvicorn would pick httptools.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import Counter
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tiderl.serving.limits import ConnectionLimits

HEADERS, BODY = "headers", "body"  # what a deadline waits for


def uvicorn_config(app: Any, host: str, port: int, limits: ConnectionLimits,
                   **options: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` on ``host:port`` with ``limits`` (``options``: uvicorn's
    other settings); each config counts its own clients' connections."""
    protocol = functools.partial(BoundedH11Protocol, limits=limits,
                                 open_per_client=Counter())
    return uvicorn.Config(app, host=host, port=port, http=protocol,  # type: ignore[arg-type]
                          ws="none", log_level="warning", **options)


def run(app: Any, host: str, port: int, limits: ConnectionLimits, **options: Any) -> None:
    """Serve ``app`` until interrupted (blocks), as :func:`uvicorn_config` sets it up."""
    uvicorn.Server(uvicorn_config(app, host, port, limits, **options)).run()


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header and a body deadline and a cap on the connections
    one client address holds (see the module's docstring). ``open_per_client`` is shared by
    every connection of one server."""

    def __init__(self, *args: Any, limits: ConnectionLimits,
                 open_per_client: Counter[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.open_per_client = open_per_client
        self.peer: str | None = None  # the client's address, once counted
        self.waiting_for: str | None = None  # HEADERS, BODY or None (no deadline)
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.client is not None:
            self.peer = self.client[0]
            self.open_per_client[self.peer] += 1
            if self.open_per_client[self.peer] > self.limits.max_per_client:
                self.app = self._refuse  # answers this connection's request, then closes it
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None:
            self.open_per_client[self.peer] -= 1
            if not self.open_per_client[self.peer]:
                del self.open_per_client[self.peer]
            self.peer = None
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def _waiting_for(self) -> str | None:
        """What the client owes now: the headers (a new connection, or a request begun after a
        kept-alive pause), the body, or nothing (the app's turn, or idle between requests)."""
        if self.transport.is_closing():
            return None
        state = self.conn.their_state
        if state is h11.IDLE:
            return None if self.timeout_keep_alive_task is not None else HEADERS
        return BODY if state is h11.SEND_BODY else None

    def _follow(self) -> None:
        """A deadline for what the client owes now: kept while it owes the same thing."""
        owed = self._waiting_for()
        if owed == self.waiting_for:
            return
        self._disarm()
        self.waiting_for = owed
        if owed is not None:
            timeout_s = self._timeout_s(owed)
            self.deadline = self.loop.call_later(timeout_s, self._expire, owed)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        self.waiting_for = None

    def _timeout_s(self, owed: str) -> float:
        return self.limits.header_timeout_s if owed == HEADERS else self.limits.body_timeout_s

    def _expire(self, owed: str) -> None:
        """The client did not send what it owed in time: 408 where no answer has begun, and
        the connection closed; an app waiting for the body sees the client go."""
        self.deadline, self.waiting_for = None, None
        is_answered = False
        if owed == BODY and self.cycle is not None:
            is_answered = self.cycle.response_started
            self.cycle.disconnected = True  # the app's receive() returns http.disconnect
            self.cycle.message_event.set()
        if not is_answered:
            message = f"request {owed} not complete within {self._timeout_s(owed):g} s"
            self.transport.write(_response(408, "Request Timeout", message, "request_timeout"))
        self.transport.close()

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI app of a connection over the cap: 503, then uvicorn closes it."""
        message = (f"too many connections from {self.peer}: the server holds "
                   f"{self.limits.max_per_client} open per client address; close one and retry")
        body = _error_body(message, "too_many_connections")
        await send({"type": "http.response.start", "status": 503,
                    "headers": [*_error_headers(body), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})


def _error_body(message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind}}).encode()


def _error_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]


def _response(status: int, reason: str, message: str, kind: str) -> bytes:
    """A whole HTTP/1.1 error response, written straight to the socket (no request to answer
    through h11: it has not been read whole)."""
    body = _error_body(message, kind)
    head = [f"HTTP/1.1 {status} {reason}".encode()]
    head += [name + b": " + value for name, value in _error_headers(body)]
    return b"\r\n".join(head) + b"\r\n\r\n" + body
