"""HTTPEnvClient's retries, errors and batches against ``httpx.MockTransport`` (a fake server:
the edge)."""

import asyncio
import json

import httpx
import pytest

from tiderl.env.client import EnvClientError, HTTPEnvClient
from tiderl.env.protocol import Completion


def client_with(answers: list, calls: list, *, batch: bool = False) -> HTTPEnvClient:
    """Each request takes the next answer: an ``httpx.Response``, an exception to raise, or a
    function of the request that returns one."""
    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        answer = answers.pop(0)
        if callable(answer):
            answer = answer(request)
        if isinstance(answer, Exception):
            raise answer
        return answer
    return HTTPEnvClient("http://env", retries=2, backoff_s=0.0, batch=batch,
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


def step_answer(session: str, done: bool = False) -> dict:
    return {"observation": f"seen by {session}", "reward": 0.0, "done": done}


def batch_of(request: httpx.Request) -> list[dict]:
    return json.loads(request.content)["calls"]


def lines(*answers: dict) -> httpx.Response:
    return httpx.Response(200, content=b"".join(json.dumps(a).encode() + b"\n" for a in answers),
                          headers={"content-type": "application/x-ndjson"})


def test_calls_made_together_share_one_batch_and_each_gets_its_own_answer():
    calls, seen = [], []

    def answer(request):
        seen.extend(batch_of(request))
        return lines(  # in the order the calls finish, not the order sent
            {"index": 2, "status": 200, "body": {"session": "s3", "state": "ended"}},
            {"index": 1, "status": 404, "body": {"error": {"message": "session 's2': unknown",
                                                          "type": "unknown_session"}}},
            {"index": 0, "status": 200, "body": step_answer("s1", done=True)})

    client = client_with([answer], calls, batch=True)

    async def together():
        return await asyncio.gather(client.step("s1", "guess 5"), client.step("s2", "guess 6"),
                                    client.end("s3"), return_exceptions=True)
    first, second, third = asyncio.run(together())
    assert calls == ["/batch"]
    assert seen == [{"call": "/observation", "body": {"session": "s1", "action": "guess 5",
                                                      "completion": None}},
                    {"call": "/observation", "body": {"session": "s2", "action": "guess 6",
                                                      "completion": None}},
                    {"call": "/end", "body": {"session": "s3"}}]
    assert (first.observation, first.done, third.state) == ("seen by s1", True, "ended")
    assert isinstance(second, EnvClientError) and second.status == 404
    assert str(second) == "/observation on session 's2' failed (404): session 's2': unknown"


def test_a_batch_cut_short_fails_its_sent_steps_and_retries_the_rest_alone():
    calls = []
    client = client_with([lines({"index": 0, "status": 200, "body": step_answer("s1")}),
                          httpx.Response(200, json={"session": "s3", "state": "paused"})],
                         calls, batch=True)

    async def together():
        return await asyncio.gather(client.step("s1", "guess 5"), client.step("s2", "guess 6"),
                                    client.pause("s3"), return_exceptions=True)
    first, second, third = asyncio.run(together())
    assert first.observation == "seen by s1" and third.state == "paused"
    assert isinstance(second, EnvClientError) and "ended before this call's" in str(second)
    assert calls == ["/batch", "/pause"]  # the step reached the server: never sent again


def test_a_refused_batch_is_sent_again_call_by_call():
    calls = []
    client = client_with([httpx.ConnectError("refused"),
                          httpx.Response(200, json=step_answer("s1")),
                          httpx.Response(200, json={"session": "s2", "state": "ended"})],
                         calls, batch=True)

    async def together():
        return await asyncio.gather(client.step("s1", "guess 5"), client.end("s2"))
    step, end = asyncio.run(together())
    assert (step.observation, end.state) == ("seen by s1", "ended")
    assert calls == ["/batch", "/observation", "/end"]  # never sent: a step may go again


def test_a_server_without_batch_is_sent_each_call_alone_from_then_on():
    calls = []
    not_found = httpx.Response(404, json={"error": {"message": "Not Found", "type": "x"}})
    client = client_with([not_found, httpx.Response(200, json=step_answer("s1")),
                          httpx.Response(200, json=step_answer("s1"))], calls, batch=True)
    asyncio.run(client.step("s1", "guess 5"))
    asyncio.run(client.step("s1", "guess 6"))
    assert calls == ["/batch", "/observation", "/observation"]


def test_a_batch_refused_whole_answers_each_call_with_its_error():
    calls = []
    client = client_with([httpx.Response(401, json={"error": {"message": "no bearer token",
                                                              "type": "unauthorized"}})],
                         calls, batch=True)

    async def together():
        return await asyncio.gather(client.step("s1", "guess 5"), client.end("s2"),
                                    return_exceptions=True)
    errors = asyncio.run(together())
    assert [(e.call, e.status) for e in errors] == [("/observation", 401), ("/end", 401)]
    assert calls == ["/batch"]  # 4xx: never retried


def test_an_agents_calls_go_alone():
    calls = []
    client = client_with([httpx.Response(200, json=step_answer("s1")),
                          httpx.Response(200, json=step_answer("s2"))], calls, batch=True)

    async def together():
        return await asyncio.gather(client.step("s1", "hi", Completion(token_ids=[1])),
                                    client.step("s2", "guess 1", wait_s=5.0))
    asyncio.run(together())
    assert calls == ["/observation", "/observation"]
