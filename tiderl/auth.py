"""Tokens of a job's services: the engine server's admin routes, the environment service (HTTP
bearer tokens) and the ranks' weight feeds.

    engine server  /tiderl/*                       Authorization: Bearer <admin token>
    env service    /start /observation /end ...   Authorization: Bearer <env token>
    weight feed    a fetch of a rank's weights     the weights token in the request

:class:`ServiceGuard` is the ASGI middleware both servers put in front of their routes: it
answers a protected route without the token 401 and a body over the size limit 413 (the JSON
error format of both servers, the body read and dropped first, so the connection stays usable)
before any route reads it.

A token comes, first found first, from the explicit value (the ``admin_token`` / ``token``
argument of a server's ``serve`` or of a client), its environment variable (``TIDERL_ADMIN_TOKEN``,
``TIDERL_ENV_TOKEN``), or the job: where ``TIDERL_JOB_KEYS`` names a job's keys folder
(``runs/<job>/keys``, 0700, made at launch), the token is an HMAC of its ``http.secret`` (32
random bytes, 0600, on every node with a rank, an engine server or the environment service;
:mod:`tiderl.runtime.bus.keys`), one token per purpose. The launcher sets ``TIDERL_JOB_KEYS``
for the environment service, the engine servers and the ranks (:mod:`tiderl.launch.plan`), so
every job has its own random tokens, and no token is on a command line.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from tiderl.core.quote import one_line

ADMIN = "admin"  # the engine server's admin routes
ENV = "env"  # the environment service
WEIGHTS = "weights"  # a rank's weight feed (tiderl.trainer.weight_feed)
TOKEN_VARS = {ADMIN: "TIDERL_ADMIN_TOKEN", ENV: "TIDERL_ENV_TOKEN",
              WEIGHTS: "TIDERL_WEIGHTS_TOKEN"}
JOB_KEYS_VAR = "TIDERL_JOB_KEYS"
HTTP_SECRET = "http.secret"  # the file in the job's keys folder the tokens derive from


class TokenError(RuntimeError):
    """A job's keys folder without a readable HTTP secret."""


def job_token(keys_dir: str | Path, purpose: str) -> str:
    """The job's token for ``purpose`` (:data:`ADMIN`, :data:`ENV`, :data:`WEIGHTS`): 64 hex
    characters."""
    path = Path(keys_dir) / HTTP_SECRET
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise TokenError(f"{path}: cannot read the job's HTTP secret ({exc.strerror})") from None
    if not secret:
        raise TokenError(f"{path}: empty")
    return hmac.new(secret, f"tiderl-http-{purpose}".encode(), hashlib.sha256).hexdigest()


def resolve_token(purpose: str, explicit: str | None = None,
                  environ: Mapping[str, str] | None = None) -> str | None:
    """The token for ``purpose``: ``explicit``, else its environment variable, else the job's
    (``TIDERL_JOB_KEYS``), else None (no token)."""
    if explicit:
        return explicit
    environ = os.environ if environ is None else environ
    value = environ.get(TOKEN_VARS[purpose], "")
    if value:
        return value
    keys = environ.get(JOB_KEYS_VAR, "")
    return job_token(keys, purpose) if keys else None


def bearer_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``token`` (constant-time compare)."""
    scheme, _, value = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(),
                                                              token.encode())


Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
LOOPBACK = ("127.0.0.1", "::1")


class ServiceGuard:
    """ASGI middleware: the token on the routes ``is_protected`` says, a size limit on bodies.

    With ``token`` None a protected route is served to loopback clients only
    (``loopback_without_token``) or to everyone. A body is read whole here (at most
    ``max_body_bytes``) and handed to the route as one message.
    """

    def __init__(self, app: Callable[..., Awaitable[None]], *, token: str | None,
                 is_protected: Callable[[str], bool], max_body_bytes: int,
                 loopback_without_token: bool) -> None:
        self.app = app
        self.token = token
        self.is_protected = is_protected
        self.max_body_bytes = max_body_bytes
        self.loopback_without_token = loopback_without_token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        read = await _read_body(receive, self.max_body_bytes)
        if read is None:  # the client went away (or was cut off) before the body's end
            return
        body, too_big = read
        if refusal is None and too_big:
            refusal = (413, f"request body over {self.max_body_bytes} bytes", "body_too_large")
        if refusal is not None:
            await _send_error(send, *refusal)
            return
        await self.app(scope, _replay(body, receive), send)

    def _refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        if not self.is_protected(scope.get("path", "")):
            return None
        if self.token is None:
            client = (scope.get("client") or ("",))[0]
            if not self.loopback_without_token or client in LOOPBACK:
                return None
            return (403, "this server has no admin token: its admin routes answer loopback "
                         "clients only", "forbidden")
        headers = dict(scope.get("headers") or ())
        header = headers.get(b"authorization", b"").decode("latin-1")
        if is_authorized(header, self.token):
            return None
        what = "a wrong" if header else "no"
        return (401, f"{what} bearer token: send 'Authorization: Bearer TOKEN'",
                "unauthorized")


async def _read_body(receive: Receive, limit: int) -> tuple[bytes, bool] | None:
    """The whole body (dropped past ``limit``: then (b"", True)); reads to its end either way.
    None: the client went away first (no route runs on part of a body)."""
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        more = message.get("more_body", False)
    return (b"", True) if size > limit else (b"".join(chunks), False)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # a later disconnect
    return replay


def error_body(message: str, kind: str, **extra: Any) -> dict[str, Any]:
    """The JSON error both servers answer with: ``{"error": {"message", "type", ...}}``, the
    message one bounded line (:func:`tiderl.core.quote.one_line`) whatever the exception said
    or quoted."""
    return {"error": {"message": one_line(message), "type": kind, **extra}}


async def _send_error(send: Send, status: int, message: str, kind: str) -> None:
    body = json.dumps(error_body(message, kind)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
