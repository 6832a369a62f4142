"""The environment service's /batch: each call answered as its route would answer it, each line
as soon as its call is done; the app driven in process (starlette's TestClient)."""

import asyncio
import json

import msgspec
import pytest
from starlette.testclient import TestClient

from tiderl.env.config import EnvConfig
from tiderl.env.guess import GuessEnv
from tiderl.env.protocol import BatchCall
from tiderl.env.server import Answer, batch_answers, build_app


@pytest.fixture
def http():
    with TestClient(build_app(EnvConfig())) as client:
        yield client


def post_batch(http: TestClient, *calls: tuple[str, dict]) -> list[dict]:
    body = {"calls": [{"call": call, "body": body} for call, body in calls]}
    response = http.post("/batch", content=json.dumps(body))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-ndjson"
    return [json.loads(line) for line in response.text.splitlines()]


def test_each_call_gets_what_its_route_answers(http):
    answers = post_batch(http, ("/start", {"env": "guess", "task": "1 10", "seed": 3}),
                         ("/start", {"env": "nope"}),
                         ("/observation", {"session": "zz", "action": "guess 1"}),
                         ("/end", {"session": 7}))
    by_index = {a["index"]: a for a in answers}
    assert sorted(by_index) == [0, 1, 2, 3]
    started = by_index[0]
    assert started["status"] == 200 and started["body"]["session"] == "s1"
    assert (by_index[1]["status"], by_index[1]["body"]["error"]["type"]) == (400, "unknown_env")
    assert by_index[2]["body"] == {"error": {"message": "session 'zz': unknown",
                                             "type": "unknown_session"}}
    assert by_index[3]["status"] == 422 and "$.session" in by_index[3]["body"]["error"]["message"]
    solver = GuessEnv()
    solver.reset("1 10", 3)
    [step] = post_batch(http, ("/observation", {"session": "s1", "action": "guess 5"}))
    expected = solver.step("guess 5")
    assert step["status"] == 200
    assert (step["body"]["observation"], step["body"]["done"]) == (expected.observation,
                                                                   expected.done)
    metrics = http.get("/metrics").text
    assert 'tiderl_env_errors_total{route="/observation",status="404"} 1.0' in metrics
    assert "tiderl_env_steps_total 1.0" in metrics


@pytest.mark.parametrize("body,status,message", [
    (b"{nope", 400, "malformed JSON"),
    (b"{}", 422, "missing required field `calls`"),
    (b'{"calls": []}', 422, "length >= 1"),
    (b'{"calls": [{"call": "/end_owner", "body": {"owner": "x"}}]}', 422,
     "Invalid enum value '/end_owner'"),
    (b'{"calls": [{"call": "/end"}]}', 422, "missing required field `body`"),
])
def test_a_batch_that_is_not_a_list_of_calls_is_one_clear_error(http, body, status, message):
    response = http.post("/batch", content=body)
    assert response.status_code == status
    assert message in response.json()["error"]["message"]
    assert http.get("/health").json()["status"] == "ok"


def test_a_calls_retry_after_travels_in_its_line():
    async def answer(route: str, body: bytes) -> Answer:
        return Answer(429, b'{"error": {"message": "full", "type": "session_limit"}}',
                      {"Retry-After": "1"})

    async def collect():
        return [chunk async for chunk in batch_answers(
            [BatchCall("/start", msgspec.Raw(b"{}"))], answer, set())]
    [chunk] = asyncio.run(collect())
    assert json.loads(chunk) == {"index": 0, "status": 429, "retry_after_s": 1.0,
                                 "body": {"error": {"message": "full",
                                                    "type": "session_limit"}}}


def test_a_call_done_early_is_answered_before_a_slow_one_and_calls_done_together_share_a_chunk():
    delays = {b"0": 0.05, b"1": 0.0, b"2": 0.0}
    running: set[asyncio.Task] = set()

    async def answer(route: str, body: bytes) -> Answer:
        await asyncio.sleep(delays[bytes(body)])
        return Answer(200, b'{"call": %s}' % bytes(body), {})

    async def collect():
        calls = [BatchCall("/observation", msgspec.Raw(str(i).encode())) for i in range(3)]
        chunks = [chunk async for chunk in batch_answers(calls, answer, running)]
        await asyncio.sleep(0)  # the last call's task lets go of itself
        return chunks, len(running)
    chunks, num_running = asyncio.run(collect())
    assert [[json.loads(line)["index"] for line in chunk.splitlines()] for chunk in chunks] == [
        [1, 2], [0]]
    assert num_running == 0
