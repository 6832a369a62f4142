"""HTTP server of the environment service (paper App. B.1).

    client ──POST /start /observation /end /pause /resume──> build_app ──> EnvService
           ──POST /batch {calls}──> each call as its route, concurrently ──> one NDJSON line
                                    per call, written as soon as that call is done
    job    ──POST /end_owner──> ends every session a (dead) rank started
           ──GET /health──> liveness and session counts
           ──GET /metrics──> private Prometheus registry (sessions, steps, errors, step latency)
    a sweep task expires idle sessions every few seconds (each request also checks its session)

Bodies are decoded with msgspec (:mod:`tiderl.env.protocol`). Bad input is answered with
``{"error": {"message", "type"}}``: 400 malformed JSON (too deep a nesting included) / unknown
env, 401 no or a wrong token, 404 unknown, expired or evicted session (or an unknown route),
405 a wrong method, 409 a step on a paused or finished session, 413 a body over
``MAX_BODY_BYTES``, 422 missing fields, wrong types or an action over the length limit (and
``invalid_observation``: an observation whose image breaks the limits of
:mod:`tiderl.env.images`), 429 (with ``Retry-After: 1``) when the session table is full and
every session is in a step. The server keeps serving after any of them. In a /batch each call
gets the answer its route would give (:class:`BatchAnswer`: status and body); the batch itself
is answered 400/422 only when its body is not a list of calls (:class:`BatchRequest`).

Connections are bounded (``config.connections``, :mod:`tiderl.serving.uvicorn_server`): a request
whose headers or body arrive too slowly is answered 408 and its connection closed; a client
address over its cap of open connections is answered 503 (``Retry-After: 1``).

Token: with one (``serve``'s ``token``, else ``TIDERL_ENV_TOKEN``, else the job's, see
:mod:`tiderl.auth`) every route but ``/health`` and ``/metrics`` needs
``Authorization: Bearer TOKEN``; without one the service is open (it binds the loopback unless
told otherwise). A job always sets one.

No lock-out: a full session table evicts the longest-idle session not in a step (active before
paused; :mod:`tiderl.env.sessions`) instead of refusing every /start until one expires.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from tiderl.auth import ENV, ServiceGuard, error_body, resolve_token
from tiderl.env.agent_api import AgentModel, add_agent_routes, is_agent_path
from tiderl.env.config import EnvConfig
from tiderl.env.protocol import (
    BatchAnswer,
    BatchCall,
    BatchRequest,
    ObservationRequest,
    OwnerRequest,
    ProtocolError,
    SessionRequest,
    StartRequest,
    decode,
)
from tiderl.env.service import EnvService, error_status

PREFIX = "tiderl_env_"
OPEN_ROUTES = ("/health", "/metrics")  # served without the token
MAX_BODY_BYTES = 1 << 20  # actions and tasks are at most 4,096 characters
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                   10)


class EnvMetrics:
    """The app's own registry, so two apps in one process never share counters."""

    def __init__(self, service: EnvService) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        table = service.table
        Gauge(PREFIX + "sessions_open", "Sessions open (active or paused).",
              registry=self.registry).set_function(lambda: table.num_open)
        Gauge(PREFIX + "sessions_paused", "Sessions paused.",
              registry=self.registry).set_function(lambda: table.num_paused)
        Gauge(PREFIX + "sessions_expired", "Sessions expired since start.",
              registry=self.registry).set_function(lambda: table.counters.num_expired)
        Gauge(PREFIX + "sessions_rejected", "Starts refused: a full table, all in a step.",
              registry=self.registry).set_function(lambda: table.counters.num_rejected)
        Gauge(PREFIX + "sessions_evicted", "Sessions evicted to make room on a full table.",
              registry=self.registry).set_function(lambda: table.counters.num_evicted)
        self.starts = Counter(PREFIX + "starts", "Sessions started.", registry=self.registry)
        self.steps = Counter(PREFIX + "steps", "Environment steps.", registry=self.registry)
        self.batches = Counter(PREFIX + "batches", "/batch requests (each call also counts as "
                               "its route's).", registry=self.registry)
        self.errors = Counter(PREFIX + "errors", "Requests answered with an error.",
                              ["route", "status"], registry=self.registry)
        self.step_latency = Histogram(PREFIX + "step_latency_seconds",
                                      "Time to answer /observation (latency model included).",
                                      buckets=LATENCY_BUCKETS, registry=self.registry)


JSON, NDJSON = "application/json", "application/x-ndjson"
Handler = Callable[[bytes], Awaitable[Any]]  # a route's work on its body


class Answer(NamedTuple):
    """What a route answers: its status, JSON body and extra headers."""

    status: int
    body: bytes
    headers: dict[str, str]


class Routes:
    """The protocol's routes as functions of a request body, for the HTTP routes and /batch's
    calls alike: what each answers (:class:`Answer`), every failure a JSON error."""

    def __init__(self, service: EnvService, metrics: EnvMetrics) -> None:
        self.service = service
        self.metrics = metrics
        self.handlers: dict[str, Handler] = {
            "/start": self._start, "/observation": self._observation,
            "/end": _sync(service.end, SessionRequest),
            "/pause": _sync(service.pause, SessionRequest),
            "/resume": _sync(service.resume, SessionRequest),
            "/end_owner": _sync(service.end_owner, OwnerRequest)}

    async def answer(self, route: str, body: bytes) -> Answer:
        try:
            out = await self.handlers[route](body)
        except Exception as exc:  # every failure becomes a JSON error; the server keeps going
            status, kind, headers = error_status(exc)
            self.metrics.errors.labels(route, str(status)).inc()
            message = str(exc) if status < 500 else f"{type(exc).__name__}: {exc}"
            return Answer(status, msgspec.json.encode(error_body(message, kind)), headers)
        return Answer(200, msgspec.json.encode(out), {})

    async def _start(self, body: bytes) -> Any:
        out = await self.service.start(decode(body, StartRequest))
        self.metrics.starts.inc()
        return out

    async def _observation(self, body: bytes) -> Any:
        began = time.perf_counter()
        out = await self.service.step(decode(body, ObservationRequest))
        self.metrics.steps.inc()
        self.metrics.step_latency.observe(time.perf_counter() - began)
        return out


def _sync(method: Callable[[Any], Any], kind: type[msgspec.Struct]) -> Handler:
    """The handler of a route whose work does not wait (/end, /pause, ...)."""
    async def call(body: bytes) -> Any:
        return method(decode(body, kind))
    return call


def error_response(status: int, message: str, kind: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind), status_code=status, headers=headers)


def build_app(config: EnvConfig, *, clock: Callable[[], float] = time.monotonic,
              gym: str | None = None, token: str | None = None, agent_url: str = "",
              model: AgentModel | None = None) -> FastAPI:
    """The routes over one :class:`EnvService`; ``clock`` drives idle expiry (tests inject one);
    ``token`` None: open to every client. ``agent_url``: this server's address as its agents
    reach it (``http://127.0.0.1:PORT``), where ``config.agents`` are served (the routes of
    :mod:`tiderl.env.agent_api`, with ``model`` as they describe it; a per-task key guards them,
    not the token)."""
    service = EnvService(config, clock=clock, gym=gym)
    service.agent_url = agent_url.rstrip("/")
    service.model_path = model.path if model is not None else ""
    metrics = EnvMetrics(service)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(_sweep(service, min(5.0, config.idle_ttl_s / 4)))
        yield
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper

    app = FastAPI(title="TideRL environments", lifespan=lifespan, redirect_slashes=False)
    app.state.service = service
    service.app = app
    app.add_middleware(ServiceGuard, token=token,
                       is_protected=lambda path: path not in OPEN_ROUTES
                       and not is_agent_path(path),
                       max_body_bytes=MAX_BODY_BYTES, loopback_without_token=False)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        """Unknown routes and wrong methods: the same one-line format."""
        return error_response(exc.status_code, str(exc.detail),
                              "not_found" if exc.status_code == 404 else "invalid_request")

    routes = Routes(service, metrics)

    def route(path: str) -> None:
        async def endpoint(request: Request) -> Response:
            out = await routes.answer(path, await request.body())
            return Response(out.body, out.status, out.headers, media_type=JSON)
        app.add_api_route(path, endpoint, methods=["POST"], name=path.strip("/"))

    for path in routes.handlers:
        route(path)
    running: set[asyncio.Task] = set()  # the calls of batches in flight

    @app.post("/batch")
    async def batch(request: Request) -> Response:
        try:
            calls = decode(await request.body(), BatchRequest).calls
        except ProtocolError as exc:
            metrics.errors.labels("/batch", str(exc.status)).inc()
            return error_response(exc.status, str(exc), exc.kind)
        metrics.batches.inc()
        return StreamingResponse(batch_answers(calls, routes.answer, running), media_type=NDJSON)

    if config.agents:
        add_agent_routes(app, service, model or AgentModel())

    @app.get("/health")
    async def health() -> dict:
        return service.health()

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def batch_answers(calls: list[BatchCall], answer: Callable[[str, bytes], Awaitable[Answer]],
                        running: set[asyncio.Task]) -> AsyncIterator[bytes]:
    """/batch's answer: the calls run concurrently, as that many requests would, and each one's
    :class:`BatchAnswer` line goes out as soon as it is done (the lines of calls done together
    in one chunk). A client that goes away leaves its calls running to their end, as it does a
    single request; ``running`` holds them meanwhile."""
    lines: list[bytes] = []
    is_ready = asyncio.Event()

    async def run(index: int, call: BatchCall) -> None:
        out = await answer(call.call, call.body)
        retry_after = out.headers.get("Retry-After")
        lines.append(msgspec.json.encode(BatchAnswer(
            index, out.status, msgspec.Raw(out.body),
            float(retry_after) if retry_after else None)) + b"\n")
        is_ready.set()

    for index, call in enumerate(calls):
        task = asyncio.create_task(run(index, call))
        running.add(task)
        task.add_done_callback(running.discard)
    num_left = len(calls)
    while num_left:
        await is_ready.wait()
        is_ready.clear()
        chunk = b"".join(lines)
        num_left -= len(lines)
        lines.clear()
        yield chunk


async def _sweep(service: EnvService, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        service.table.expire(service.clock())


SERVER_KEEPALIVE_S = 75
AGENT_SHUTDOWN_S = 2.0


def serve(config: EnvConfig, host: str = "127.0.0.1", port: int = 8100,
          gym: str | None = None, token: str | None = None,
          model: AgentModel | None = None) -> None:
    """Run the app with uvicorn until interrupted (blocks), with ``config.connections``'s
    bounds (:mod:`tiderl.serving.uvicorn_server`); the token is ``token``, else
    ``TIDERL_ENV_TOKEN``, else the job's (``TIDERL_JOB_KEYS``), else none. Agents, which run on
    this host, reach it on the loopback unless it binds one address only."""
    from tiderl.serving.uvicorn_server import run

    reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    if config.agents:  # before /health answers: the launcher's wait covers it
        from tiderl.env.agents import prewarm

        prewarm(list(config.agents.values()))
    app = build_app(config, gym=gym, token=resolve_token(ENV, token),
                    agent_url=f"http://{reach}:{port}", model=model)
    # Keep idle connections longer than clients do (``KEEPALIVE_EXPIRY_S``): a server closing a
    # kept-alive connection as a client reuses it fails a non-idempotent /observation.
    # An agent's request may wait for the rank, and a /start or /observation for its agent, with
    # no end in sight at a shutdown: past AGENT_SHUTDOWN_S they are ended, not waited for.
    bound = {"timeout_graceful_shutdown": AGENT_SHUTDOWN_S} if config.agents else {}
    run(app, host, port, config.connections, access_log=False,
        timeout_keep_alive=SERVER_KEEPALIVE_S, **bound)
