"""HTTPEnvClient's retries and errors against ``httpx.MockTransport`` (a fake server: the edge)."""

import asyncio

import httpx
import pytest

from tiderl.env.client import EnvClientError, HTTPEnvClient


def client_with(answers: list, calls: list) -> HTTPEnvClient:
    """Each request takes the next answer: an ``httpx.Response`` or an exception to raise."""
    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer
    return HTTPEnvClient("http://env", retries=2, backoff_s=0.0,
                         transport=httpx.MockTransport(handler))


def error(status: int, message: str, **headers) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "x"}},
                          headers=headers)


def test_idempotent_calls_retry_on_5xx_and_dropped_connections():
    calls = []
    client = client_with([error(503, "busy"), httpx.ReadError("reset"),
                          httpx.Response(200, json={"session": "s1", "state": "ended"})], calls)
    out = asyncio.run(client.end("s1"))
    assert out.state == "ended" and calls == ["/end"] * 3


def test_step_is_not_retried_once_the_request_was_sent():
    calls = []
    client = client_with([httpx.ReadError("reset"), error(503, "busy")], calls)
    with pytest.raises(EnvClientError, match="/observation on session 's1' failed"):
        asyncio.run(client.step("s1", "guess 5"))
    with pytest.raises(EnvClientError, match=r"\(503\): busy"):
        asyncio.run(client.step("s1", "guess 5"))
    assert calls == ["/observation"] * 2


def test_start_retries_a_refused_connection_and_reports_429_retry_after():
    calls = []
    client = client_with([httpx.ConnectError("refused"),
                          error(429, "session limit reached", **{"Retry-After": "7"})], calls)
    with pytest.raises(EnvClientError) as info:
        asyncio.run(client.start("guess"))
    assert (info.value.call, info.value.status, info.value.retry_after_s) == ("/start", 429, 7.0)
    assert calls == ["/start", "/start"]


def test_4xx_is_never_retried_and_gives_up_after_the_retries():
    calls = []
    client = client_with([error(404, "session 'zz': unknown")] + [error(500, "boom")] * 3, calls)
    with pytest.raises(EnvClientError, match="/pause on session 'zz' failed \\(404\\)"):
        asyncio.run(client.pause("zz"))
    with pytest.raises(EnvClientError, match="boom"):
        asyncio.run(client.resume("zz"))
    assert calls == ["/pause"] + ["/resume"] * 3
