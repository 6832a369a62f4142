"""The engine server from its first second: it listens before torch, the model and FastAPI are
loaded, and answers ``/health`` with 503 ``{"status": "loading"}`` (every other route 503 too)
until the engine is built; then the app of :func:`tiderl.engine.server.build_app` serves on the
same socket. ``/health`` 200 still means "ready to generate", as on vLLM: the launcher, the
ranks and the tests wait for it as before, while someone who looks at the port learns at once
that the server is up and loading.

    main thread:   uvicorn ──request──> StartingApp ── still loading ──> 503 {"status": "loading"}
                                                   └─ loaded ─────────> build_app(engine) routes
    loader thread: load() (torch, weights, KV pool), build_app ──> StartingApp.app
                   load() raised ──> the server stops; serve_loading raises it

Every connection has the bounds of ``limits`` (the profile's ``engine.connections``) from the
first second: a request slow to arrive is cut off with 408, a client address over its cap is
answered 503 (:mod:`tiderl.serving.uvicorn_server`).

This module imports only uvicorn, tiderl.auth, tiderl.serving and the standard library; ``load``
runs in the loader thread (a daemon, so that Ctrl-C or SIGTERM while loading ends the process at
once).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import uvicorn

from tiderl.auth import ADMIN, resolve_token
from tiderl.serving.limits import ConnectionLimits
from tiderl.serving.uvicorn_server import uvicorn_config

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from tiderl.engine.llm_engine import LLMEngine

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Loader = Callable[[], "tuple[LLMEngine, Tokenizer | None]"]

LOADING_HEALTH = {"status": "loading"}
LOADING_ERROR = {"error": {"message": "the engine is loading: retry when /health answers 200",
                           "type": "loading"}}


class StartingApp:
    """The ASGI app uvicorn serves: 503 until ``app`` is set, then ``app``. It runs the
    lifespan itself: at shutdown it closes the engine, if one was loaded."""

    def __init__(self) -> None:
        self.app: ASGIApp | None = None
        self.engine: LLMEngine | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            body = LOADING_HEALTH if scope["path"] == "/health" else LOADING_ERROR
            await _send_json(send, 503, body)
        else:  # a websocket: no route takes one
            await send({"type": "websocket.close", "code": 1013})  # try again later

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.engine is not None:
                    await self.engine.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _send_json(send: Send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()),
                            (b"retry-after", b"1")]})
    await send({"type": "http.response.body", "body": data})


class LoadingServer(uvicorn.Server):
    """uvicorn's server over a :class:`StartingApp`: once it listens, a loader thread calls
    ``load()`` and builds the engine's app; an exception from ``load`` stops the server and
    is kept in ``failure``."""

    def __init__(self, load: Loader, host: str = "127.0.0.1", port: int = 8000,
                 model_name: str = "tiderl", admin_token: str | None = None,
                 limits: ConnectionLimits | None = None) -> None:
        self.shell = StartingApp()
        super().__init__(uvicorn_config(self.shell, host, port, limits or ConnectionLimits()))
        self.load, self.model_name, self.admin_token = load, model_name, admin_token
        self.failure: BaseException | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # listening: load now (not before: the GIL would slow the bind)
            threading.Thread(target=self._load, name="tiderl-load", daemon=True).start()

    def _load(self) -> None:
        try:
            engine, tokenizer = self.load()
            from tiderl.engine.server import build_app

            token = resolve_token(ADMIN, self.admin_token)
            app = build_app(engine, tokenizer, self.model_name, token)
        except BaseException as exc:  # raised again by serve_loading, in the main thread
            self.failure = exc
            self.should_exit = True
            return
        self.shell.engine, self.shell.app = engine, app


def serve_loading(load: Loader, host: str = "127.0.0.1", port: int = 8000,
                  model_name: str = "tiderl", admin_token: str | None = None,
                  limits: ConnectionLimits | None = None) -> None:
    """Listen on ``host:port`` at once, call ``load()`` (engine, tokenizer) in a loader thread
    and serve the engine's app once it returns, with ``limits`` (None: the defaults) on every
    connection; blocks until interrupted. An exception from ``load`` stops the server and is
    raised here. The admin token is ``admin_token``, else ``TIDERL_ADMIN_TOKEN``, else the
    job's (``TIDERL_JOB_KEYS``), else none (:mod:`tiderl.auth`)."""
    server = LoadingServer(load, host, port, model_name, admin_token, limits)
    server.run()
    if server.failure is not None:
        raise server.failure
