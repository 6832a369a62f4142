"""Clients of the environment service: one interface, two implementations.

* :class:`HTTPEnvClient`: the protocol over HTTP (httpx), sending the service's token
  (:mod:`tiderl.auth`). Each attempt has a timeout (``timeout_s``); failed attempts are sent
  again with exponential backoff, ``retries`` times at most, and a call gives up
  after ``deadline_s`` in all, so a stalled service (SIGSTOP) fails the task instead of hanging
  it. What is retried:

  ======================================  ============================================
  call                                    retried on
  ======================================  ============================================
  /end, /pause, /resume, /health          connect errors, timeouts, dropped connections, 5xx
  /start                                  the same (a start that reached a stalled server
                                          may leave an orphan session: the first the table
                                          evicts when full, or it expires after the idle TTL)
  /observation                            connect errors only (the request surely never
                                          reached the server: a step is not idempotent)
  ======================================  ============================================

  4xx answers are never retried. After the last attempt the call raises, and the rank ends the
  task with reward 0 (the coordinator drops its group and counts it).

  Calls made in the same turn of the event loop (a rank's tasks stepping their sessions) share
  one ``POST /batch`` request, each answered as soon as its call is done
  (:mod:`tiderl.env.client_batch`); the first attempt only, the same rules apply: a batch that
  never reached the server is sent again call by call, one cut off after it was sent fails its
  steps and retries its other calls alone. An agent's calls (``wait_s``, ``completion``) go
  alone, as every call to a server without /batch.
* :class:`InProcessEnvClient`: the same calls on an in-process :class:`EnvService` (the embedded
  default): no HTTP, the same session table and the same errors (status codes included).

Every failure is an :class:`EnvClientError` that names the call and the session.

Both return the protocol's answers: :class:`StartResponse` (``observation``, ``messages``,
``tools``) and :class:`ObservationResponse` (``observation``, ``messages``, ``reward``, ``done``),
whose messages are :class:`Message` s with :class:`ToolCall` s (re-exported here), their
content text or text and PNG image parts (:meth:`Message.text`, :meth:`Message.images`). An
answer whose image breaks the limits of :mod:`tiderl.env.images` fails the call ("unexpected
answer"), as any answer that does not decode.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any, TypeVar

import httpx
import msgspec

from tiderl.auth import ENV, bearer_headers, resolve_token
from tiderl.core.quote import short
from tiderl.env.client_batch import JSON_HEADERS, Answer, CallBatcher, NotBatched, parse_retry_after
from tiderl.env.config import EnvConfig
from tiderl.env.protocol import (
    Completion,
    Message,
    ObservationRequest,
    ObservationResponse,
    SessionRequest,
    SessionResponse,
    StartRequest,
    StartResponse,
    ToolCall,
    ToolFunction,
)
from tiderl.env.service import EnvService, error_status

__all__ = ["EnvClient", "EnvClientError", "HTTPEnvClient", "InProcessEnvClient", "Message",
           "ObservationResponse", "SessionResponse", "StartResponse", "ToolCall", "ToolFunction",
           "end_sessions_of"]

R = TypeVar("R")


class EnvClientError(Exception):
    """A failed call: ``call`` (/start, ...), ``session`` (or None), HTTP-like ``status``."""

    def __init__(self, call: str, session: str | None, status: int | None, message: str,
                 retry_after_s: float | None = None):
        where = f"{call} on session {short(session)}" if session else call
        super().__init__(f"{where} failed ({status or 'no answer'}): {message}")
        self.call = call
        self.session = session
        self.status = status
        self.retry_after_s = retry_after_s


class EnvClient(ABC):
    """Start, step, pause, resume and end environment sessions."""

    @abstractmethod
    async def start(self, env: str, task: str | None = None, seed: int = 0, *,
                    task_id: str = "", group_id: str = "", wait_s: float | None = None
                    ) -> StartResponse:
        """``task_id``, ``group_id``: the job's names (an agent's endpoint is named by its
        task); ``wait_s``: how long this call may take (an agent's start waits for its first
        model request), instead of the client's bounds."""

    @abstractmethod
    async def step(self, session: str, action: str, completion: Completion | None = None, *,
                   wait_s: float | None = None) -> ObservationResponse:
        """``completion``: the model's answer as sampled (an agent session's); ``wait_s`` as
        for ``start`` (an agent's step waits for its next request)."""

    @abstractmethod
    async def end(self, session: str) -> SessionResponse: ...

    @abstractmethod
    async def pause(self, session: str) -> SessionResponse: ...

    @abstractmethod
    async def resume(self, session: str) -> SessionResponse: ...

    @abstractmethod
    async def health(self) -> dict[str, Any]: ...

    async def close(self) -> None:
        return None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


KEEPALIVE_EXPIRY_S = 30.0  # below the server's keep-alive (tiderl.env.server), see there
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)  # never reached it


class _Retryable(Exception):
    """A failed attempt that may be sent again; ``error`` is what the call raises if none is
    left."""

    def __init__(self, error: EnvClientError):
        super().__init__(str(error))
        self.error = error


class HTTPEnvClient(EnvClient):
    def __init__(self, url: str, *, timeout_s: float = 30.0, retries: int = 3,
                 backoff_s: float = 0.1, max_backoff_s: float = 5.0,
                 deadline_s: float = 60.0, token: str | None = None,
                 max_connections: int = 256, owner: str = "", batch: bool = True,
                 transport: httpx.AsyncBaseTransport | None = None):
        """``token`` None: ``TIDERL_ENV_TOKEN``, else the job's, else none (:mod:`tiderl.auth`);
        ``owner``: sent with each /start (a job's rank: ``rank-3``, see :func:`end_sessions_of`);
        ``batch``: calls made in the same turn of the event loop share one /batch request
        (:mod:`tiderl.env.client_batch`), except those with a ``wait_s`` or a ``completion``
        (an agent's), which go alone."""
        self.owner = owner
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s,
                                      limits=limits, transport=transport,
                                      headers=bearer_headers(resolve_token(ENV, token)))
        self.batcher = CallBatcher(self.http) if batch else None
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.deadline_s = deadline_s

    async def start(self, env: str, task: str | None = None, seed: int = 0, *,
                    task_id: str = "", group_id: str = "", wait_s: float | None = None
                    ) -> StartResponse:
        return await self._post("/start", StartRequest(env, task, seed, self.owner, task_id,
                                                       group_id), StartResponse,
                                session=None, idempotent=True, wait_s=wait_s)

    async def step(self, session: str, action: str, completion: Completion | None = None, *,
                   wait_s: float | None = None) -> ObservationResponse:
        return await self._post("/observation", ObservationRequest(session, action, completion),
                                ObservationResponse, session=session, idempotent=False,
                                wait_s=wait_s, can_batch=completion is None)

    async def end(self, session: str) -> SessionResponse:
        return await self._session_call("/end", session)

    async def pause(self, session: str) -> SessionResponse:
        return await self._session_call("/pause", session)

    async def resume(self, session: str) -> SessionResponse:
        return await self._session_call("/resume", session)

    async def health(self) -> dict[str, Any]:
        answer = await self._send("/health", None, None, idempotent=True)
        return msgspec.json.decode(answer.content)

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.close()
        await self.http.aclose()

    async def _session_call(self, call: str, session: str) -> SessionResponse:
        return await self._post(call, SessionRequest(session), SessionResponse, session=session,
                                idempotent=True)

    async def _post(self, call: str, body: msgspec.Struct, kind: type[R], *,
                    session: str | None, idempotent: bool, wait_s: float | None = None,
                    can_batch: bool = True) -> R:
        answer = await self._send(call, msgspec.json.encode(body), session,
                                  idempotent=idempotent, wait_s=wait_s,
                                  can_batch=can_batch and wait_s is None)
        try:
            return msgspec.json.decode(answer.content, type=kind)
        except msgspec.MsgspecError as exc:
            raise EnvClientError(call, session, answer.status,
                                 f"unexpected answer: {exc}") from exc

    async def _send(self, call: str, content: bytes | None, session: str | None, *,
                    idempotent: bool, wait_s: float | None = None,
                    can_batch: bool = False) -> Answer:
        """One call: attempts until an answer, a failure that is not retried, the last attempt
        or the deadline. ``idempotent`` False: only attempts that never reached the server are
        sent again. ``wait_s``: the attempt's timeout and the call's deadline both.
        ``can_batch``: the first attempt goes in a /batch (where the client batches)."""
        deadline = self.deadline_s if wait_s is None else wait_s
        try:
            async with asyncio.timeout(deadline):
                for attempt in range(self.retries + 1):
                    if attempt:
                        await asyncio.sleep(self._backoff_s(attempt))
                    try:
                        return await self._attempt(call, content, session, idempotent, wait_s,
                                                   is_batched=can_batch and not attempt)
                    except _Retryable as exc:
                        if attempt == self.retries:
                            raise exc.error from exc.__cause__
        except TimeoutError:
            raise EnvClientError(call, session, None, f"no answer within the call's deadline "
                                 f"({deadline:g} s)") from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _backoff_s(self, attempt: int) -> float:
        """The pause before attempt ``attempt`` (1: the first retry): ``backoff_s`` doubling,
        at most ``max_backoff_s``. (A loop of our own: tenacity's per-call objects cost more
        than the rest of a batched step.)"""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))

    async def _attempt(self, call: str, content: bytes | None, session: str | None,
                       idempotent: bool, wait_s: float | None = None,
                       is_batched: bool = False) -> Answer:
        try:
            answer = await self._exchange(call, content, wait_s, is_batched)
        except httpx.TransportError as exc:
            error = EnvClientError(call, session, None, f"{type(exc).__name__}: {exc}")
            if isinstance(exc, NOT_SENT) or idempotent:
                raise _Retryable(error) from exc
            raise error from exc
        if answer.status >= 500 and idempotent:
            raise _Retryable(_http_error(call, session, answer))
        if answer.status >= 400:
            raise _http_error(call, session, answer)
        return answer

    async def _exchange(self, call: str, content: bytes | None, wait_s: float | None,
                        is_batched: bool) -> Answer:
        """The call's answer, in a /batch or alone; an ``httpx.TransportError`` if none came."""
        if is_batched and self.batcher is not None and self.batcher.is_supported:
            try:
                return await self.batcher.submit(call, content or b"")
            except NotBatched:
                pass  # nothing ran: alone, then
        if content is None:
            response = await self.http.get(call)
        else:
            timeout = httpx.USE_CLIENT_DEFAULT if wait_s is None else wait_s
            response = await self.http.post(call, content=content, headers=JSON_HEADERS,
                                            timeout=timeout)
        return Answer(response.status_code, response.content,
                      parse_retry_after(response.headers.get("retry-after")))


def _http_error(call: str, session: str | None, answer: Answer) -> EnvClientError:
    try:
        message = msgspec.json.decode(answer.content)["error"]["message"]
    except (msgspec.MsgspecError, KeyError, TypeError):
        message = bytes(answer.content)[:200].decode("utf-8", "replace")
    return EnvClientError(call, session, answer.status, message, answer.retry_after_s)


class InProcessEnvClient(EnvClient):
    """The embedded default: an :class:`EnvService` in this process, no HTTP."""

    def __init__(self, config: EnvConfig | None = None, *, service: EnvService | None = None,
                 **service_kwargs: Any):
        self.service = service or EnvService(config or EnvConfig(), **service_kwargs)

    async def start(self, env: str, task: str | None = None, seed: int = 0, *,
                    task_id: str = "", group_id: str = "", wait_s: float | None = None
                    ) -> StartResponse:
        return await self._call("/start", None, self.service.start(
            StartRequest(env, task, seed, task_id=task_id, group_id=group_id)))

    async def step(self, session: str, action: str, completion: Completion | None = None, *,
                   wait_s: float | None = None) -> ObservationResponse:
        return await self._call("/observation", session, self.service.step(
            ObservationRequest(session, action, completion)))

    async def end(self, session: str) -> SessionResponse:
        return await self._call("/end", session, _ready(self.service.end, session))

    async def pause(self, session: str) -> SessionResponse:
        return await self._call("/pause", session, _ready(self.service.pause, session))

    async def resume(self, session: str) -> SessionResponse:
        return await self._call("/resume", session, _ready(self.service.resume, session))

    async def health(self) -> dict[str, Any]:
        return self.service.health()

    async def _call(self, call: str, session: str | None, work: Any) -> Any:
        try:
            return await work
        except Exception as exc:
            status, _, headers = error_status(exc)
            if status >= 500:
                raise
            retry_after = headers.get("Retry-After")
            raise EnvClientError(call, session, status, str(exc),
                                 float(retry_after) if retry_after else None) from exc


async def _ready(method: Any, session: str) -> SessionResponse:
    return method(SessionRequest(session))


def end_sessions_of(url: str, owner: str, *, token: str | None = None,
                    timeout_s: float = 2.0) -> int:
    """End every session ``owner`` started on the service at ``url`` (a rank that died: its
    sessions would otherwise hold the table until they expire); how many. One bounded call: an
    EnvClientError if the service does not answer."""
    headers = bearer_headers(resolve_token(ENV, token))
    try:
        response = httpx.post(f"{url.rstrip('/')}/end_owner", json={"owner": owner},
                              headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise EnvClientError("/end_owner", None, None, f"{type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise EnvClientError("/end_owner", None, response.status_code, response.text[:200])
    return int(response.json()["ended"])

