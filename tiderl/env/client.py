"""Clients of the environment service: one interface, two implementations.

* :class:`HTTPEnvClient`: the protocol over HTTP (httpx), with timeouts and retries with
  exponential backoff for idempotent calls (/end, /pause, /resume, /health). /start and
  /observation change state, so they are retried only when the request never reached the server
  (a refused connection).
* :class:`InProcessEnvClient`: the same calls on an in-process :class:`EnvService` (the embedded
  default): no HTTP, the same session table and the same errors (status codes included).

Every failure is an :class:`EnvClientError` that names the call and the session.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any, TypeVar

import httpx
import msgspec

from tiderl.env.config import EnvConfig
from tiderl.env.protocol import (
    ObservationRequest,
    ObservationResponse,
    SessionRequest,
    SessionResponse,
    StartRequest,
    StartResponse,
)
from tiderl.env.service import EnvService, error_status

R = TypeVar("R")


class EnvClientError(Exception):
    """A failed call: ``call`` (/start, ...), ``session`` (or None), HTTP-like ``status``."""

    def __init__(self, call: str, session: str | None, status: int | None, message: str,
                 retry_after_s: float | None = None):
        where = f"{call} on session {session!r}" if session else call
        super().__init__(f"{where} failed ({status or 'no answer'}): {message}")
        self.call = call
        self.session = session
        self.status = status
        self.retry_after_s = retry_after_s


class EnvClient(ABC):
    """Start, step, pause, resume and end environment sessions."""

    @abstractmethod
    async def start(self, env: str, task: str | None = None, seed: int = 0) -> StartResponse: ...

    @abstractmethod
    async def step(self, session: str, action: str) -> ObservationResponse: ...

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


class HTTPEnvClient(EnvClient):
    def __init__(self, url: str, *, timeout_s: float = 30.0, retries: int = 3,
                 backoff_s: float = 0.1, max_connections: int = 256,
                 transport: httpx.AsyncBaseTransport | None = None):
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s,
                                      limits=limits, transport=transport)
        self.retries = retries
        self.backoff_s = backoff_s

    async def start(self, env: str, task: str | None = None, seed: int = 0) -> StartResponse:
        return await self._post("/start", StartRequest(env, task, seed), StartResponse,
                                session=None, idempotent=False)

    async def step(self, session: str, action: str) -> ObservationResponse:
        return await self._post("/observation", ObservationRequest(session, action),
                                ObservationResponse, session=session, idempotent=False)

    async def end(self, session: str) -> SessionResponse:
        return await self._session_call("/end", session)

    async def pause(self, session: str) -> SessionResponse:
        return await self._session_call("/pause", session)

    async def resume(self, session: str) -> SessionResponse:
        return await self._session_call("/resume", session)

    async def health(self) -> dict[str, Any]:
        response = await self._send("/health", None, None, idempotent=True)
        return response.json()

    async def close(self) -> None:
        await self.http.aclose()

    async def _session_call(self, call: str, session: str) -> SessionResponse:
        return await self._post(call, SessionRequest(session), SessionResponse, session=session,
                                idempotent=True)

    async def _post(self, call: str, body: msgspec.Struct, kind: type[R], *,
                    session: str | None, idempotent: bool) -> R:
        response = await self._send(call, msgspec.json.encode(body), session,
                                    idempotent=idempotent)
        try:
            return msgspec.json.decode(response.content, type=kind)
        except msgspec.MsgspecError as exc:
            raise EnvClientError(call, session, response.status_code,
                                 f"unexpected answer: {exc}") from exc

    async def _send(self, call: str, content: bytes | None, session: str | None, *,
                    idempotent: bool) -> httpx.Response:
        for attempt in range(self.retries + 1):
            last = attempt == self.retries
            try:
                if content is None:
                    response = await self.http.get(call)
                else:
                    response = await self.http.post(
                        call, content=content, headers={"content-type": "application/json"})
            except httpx.ConnectError as exc:  # never reached the server: safe to send again
                if last:
                    raise EnvClientError(call, session, None, str(exc) or "connect") from exc
            except httpx.TransportError as exc:
                if last or not idempotent:
                    raise EnvClientError(call, session, None,
                                         f"{type(exc).__name__}: {exc}") from exc
            else:
                if response.status_code < 400:
                    return response
                if response.status_code < 500 or last or not idempotent:
                    raise _http_error(call, session, response)
            await asyncio.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")


def _http_error(call: str, session: str | None, response: httpx.Response) -> EnvClientError:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200]
    retry_after = response.headers.get("retry-after")
    return EnvClientError(call, session, response.status_code, message,
                          float(retry_after) if retry_after else None)


class InProcessEnvClient(EnvClient):
    """The embedded default: an :class:`EnvService` in this process, no HTTP."""

    def __init__(self, config: EnvConfig | None = None, *, service: EnvService | None = None,
                 **service_kwargs: Any):
        self.service = service or EnvService(config or EnvConfig(), **service_kwargs)

    async def start(self, env: str, task: str | None = None, seed: int = 0) -> StartResponse:
        return await self._call("/start", None, self.service.start(StartRequest(env, task, seed)))

    async def step(self, session: str, action: str) -> ObservationResponse:
        return await self._call("/observation", session,
                                self.service.step(ObservationRequest(session, action)))

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
