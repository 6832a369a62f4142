"""The real `tiderl env serve` process driven over HTTP: lifecycle, bad input, fuzz."""

import asyncio
import json
import re
import threading
import time

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.serving import env_serving, free_port, run_env_scenario, wait_healthy
from tests.integration.test_cli import assert_one_line_error, tiderl
from tiderl.env.client import EnvClientError, HTTPEnvClient, Message, end_sessions_of
from tiderl.env.config import EnvConfig, LatencyConfig
from tiderl.env.guess import GuessEnv
from tiderl.env.protocol import MAX_ACTION_CHARS
from tiderl.env.server import build_app
from tiderl.serving.limits import ConnectionLimits
from tiderl.serving.uvicorn_server import uvicorn_config

MAX_SESSIONS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with env_serving(tmp_path_factory.mktemp("env"), "guess,shop", "--max-sessions",
                     str(MAX_SESSIONS), "--idle-ttl", "60") as served:
        yield served


def run(server, scenario):
    return run_env_scenario(server["url"], scenario)



async def play_against_solver(client, session: str, solver: GuessEnv, max_steps: int = 20):
    """Step ``session`` with the solver's actions until the game is done, every answer checked
    against the solver's own; the answers."""
    outs = []
    for _ in range(max_steps):
        action = solver.solve()
        expected = solver.step(action)
        out = await client.step(session, action)
        assert (out.observation, out.reward, out.done) == (
            expected.observation, expected.reward, expected.done)
        outs.append(out)
        if out.done:
            break
    return outs

def test_guess_episode_with_the_scripted_solver_pause_resume_end(server):
    async def scenario(client):
        started = await client.start("guess", "1 500", seed=7)
        solver = GuessEnv()
        assert solver.reset("1 500", 7) == (started.observation, started.info)
        await client.pause(started.session)
        with pytest.raises(EnvClientError, match="paused") as info:
            await client.step(started.session, "guess 1")
        assert info.value.status == 409
        await client.resume(started.session)
        outs = await play_against_solver(client, started.session, solver)
        assert outs[-1].done and outs[-1].reward == 1.0 and len(outs) <= 9
        assert (await client.end(started.session)).state == "ended"
        with pytest.raises(EnvClientError, match=f"/end on session '{started.session}'") as info:
            await client.end(started.session)
        assert info.value.status == 404
        shop = await client.start("shop", None, seed=1)
        assert shop.observation
        await client.end(shop.session)
        return await client.http.get("/metrics")

    text = run(server, scenario).text
    assert "tiderl_env_steps_total" in text and "tiderl_env_step_latency_seconds_bucket" in text
    assert 'tiderl_env_errors_total{route="/end",status="404"}' in text


def test_concurrent_episodes_share_batches_and_each_session_sees_its_own_game(server):
    """The client's calls of one event-loop turn travel in one /batch; each session's answers
    are its own (a solver per session checks every observation)."""
    async def episode(client, seed):
        started = await client.start("guess", "1 200", seed=seed)
        solver = GuessEnv()
        assert solver.reset("1 200", seed) == (started.observation, started.info)
        outs = await play_against_solver(client, started.session, solver)
        await client.end(started.session)
        return outs[-1].done

    def num_batches() -> float:
        metrics = httpx.get(server["url"] + "/metrics", timeout=5).text
        return float(re.search(r"^tiderl_env_batches_total (\S+)$", metrics, re.M).group(1))

    async def scenario(client):
        return await asyncio.gather(*(episode(client, seed) for seed in range(MAX_SESSIONS)))

    before = num_batches()
    assert run(server, scenario) == [True] * MAX_SESSIONS
    assert num_batches() - before <= 12  # a start, ~8 steps and an end each: in turns


def test_a_plain_text_environment_answers_one_user_message_equal_to_the_observation(server):
    async def scenario(client):
        outs = []
        for env in ("guess", "shop"):
            started = await client.start(env, None, seed=3)
            stepped = await client.step(started.session, "guess 5")
            await client.end(started.session)
            outs += [started, stepped]
        return outs

    for out in run(server, scenario):
        assert out.messages == [Message(role="user", content=out.observation)]
        assert out.observation
    raw = httpx.post(server["url"] + "/start", json={"env": "guess"}, timeout=5).json()
    assert raw["messages"] == [{"role": "user", "content": raw["observation"]}]
    assert raw["tools"] == []
    httpx.post(server["url"] + "/end", json={"session": raw["session"]}, timeout=5)


def test_a_full_table_evicts_the_longest_idle_session_instead_of_refusing(server):
    async def scenario(client):
        sessions = [(await client.start("guess")).session for _ in range(MAX_SESSIONS)]
        await client.step(sessions[0], "guess 5")  # s0 is now the most recently active
        newest = (await client.start("guess")).session  # full: sessions[1] is evicted
        try:
            with pytest.raises(EnvClientError, match="unknown") as info:
                await client.step(sessions[1], "guess 5")
            assert info.value.status == 404
            metrics = (await client.http.get("/metrics")).text
        finally:
            for session in [sessions[0], *sessions[2:], newest]:
                await client.end(session)
        return metrics

    metrics = run(server, scenario)
    assert "tiderl_env_sessions_evicted 1.0" in metrics
    assert "tiderl_env_sessions_rejected 0.0" in metrics


BAD = [
    ("/start", b"{not json", 400, "malformed JSON"),
    ("/start", b"", 400, "malformed JSON"),
    ("/start", b"[1, 2]", 422, "Expected `object`"),
    ("/start", b"{}", 422, "missing required field `env`"),
    ("/start", b'{"env": 3}', 422, "Expected `str`, got `int`"),
    ("/start", b'{"env": "guess", "seed": "x"}', 422, "$.seed"),
    ("/start", b'{"env": "nope"}', 400, "unknown environment 'nope'"),
    ("/start", b'{"env": "household"}', 400, "unknown environment"),  # not served here
    ("/start", b'{"env": "guess", "extra": 1}', 422, "unknown field `extra`"),
    ("/observation", b'{"session": "s1"}', 422, "missing required field `action`"),
    ("/observation", b'{"session": "zz", "action": "guess 1"}', 404, "session 'zz': unknown"),
    ("/observation", json.dumps({"session": "s1",
                                 "action": "x" * (MAX_ACTION_CHARS + 1)}).encode(), 422,
     "longer than the limit"),
    ("/start", b'{"env": "guess", "seed": 1e400}', 422, "Number out of range"),
    ("/start", b'{"env": "guess", "seed": 100000000000000000000}', 422, "$.seed"),
    ("/start/", b'{"env": "guess"}', 404, "Not Found"),
    ("/end", b'{"session": null}', 422, "Expected `str`, got `null`"),
    ("/pause", b'{"session": ""}', 422, "session: expected 1 to"),
    ("/resume", b'{"session": "zz"}', 404, "unknown"),
    ("/batch", b"{not json", 400, "malformed JSON"),
    ("/batch", b'{"calls": [{"call": "/start", "body": {}}], "x": 1}', 422, "unknown field `x`"),
    ("/batch", b'{"calls": [{"call": "/health", "body": {}}]}', 422, "Invalid enum value"),
    ("/batch", json.dumps({"calls": [{"call": "/end", "body": {"session": "s1"}}] * 1025}).encode(),
     422, "length <= 1024"),
]


@pytest.mark.parametrize("route,body,status,message", BAD)
def test_bad_input_is_a_clear_4xx_and_the_server_keeps_serving(server, route, body, status,
                                                                message):
    response = httpx.post(server["url"] + route, content=body,
                          headers={"content-type": "application/json"}, timeout=5)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    assert httpx.get(server["url"] + "/health", timeout=5).json()["status"] == "ok"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=10)
FIELDS = st.sampled_from(["env", "task", "seed", "session", "action"])
BODIES = (st.dictionaries(FIELDS, JSON, max_size=4).map(json.dumps)
          | JSON.map(json.dumps) | st.text(max_size=40))


@pytest.fixture(scope="module")
def http(server):
    """One client for the fuzzed requests (a new one loads the CA bundle: 40 ms of CPU each)."""
    with httpx.Client(base_url=server["url"], timeout=5) as client:
        yield client


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(["/start", "/observation", "/end", "/pause", "/resume", "/batch"]),
       body=BODIES)
def test_fuzz_never_5xx(http, route, body):
    response = http.post(route, content=body.encode(),
                         headers={"content-type": "application/json"})
    assert response.status_code < 500, (route, body, response.text)
    if response.status_code == 200 and route == "/start":  # keep the table from filling
        http.post("/end", json={"session": response.json()["session"]})


def test_server_is_alive_after_all_of_it(server):
    assert server["proc"].poll() is None
    health = httpx.get(server["url"] + "/health", timeout=5).json()
    assert health["envs"] == ["guess", "shop"]
    assert "Traceback" not in server["log"].read_text()


ERROR_BOUND = 1000  # characters of an error body's message, whatever the request held


def test_a_huge_value_is_an_error_under_the_bound_naming_the_field(server):
    with httpx.Client(base_url=server["url"], timeout=30) as http:
        big = "x" * 1_000_000  # the largest a body under the 1 MiB limit holds
        response = http.post("/start", json={"env": big})
        assert response.status_code == 400, response.text[:2000]
        message = response.json()["error"]["message"]
        assert len(message) < ERROR_BOUND, message[:2000]
        assert message.startswith("env: unknown environment 'xxx")
        assert "… (1,000,000 characters)" in message
        response = http.post("/start", json={"env": "guess", "task": "x" * 10_000_000})
        assert response.status_code == 413
        assert response.json()["error"]["message"] == "request body over 1048576 bytes"
        assert http.get("/health").json()["status"] == "ok"


def test_unknown_env_on_the_command_line_is_one_line_exit_2():
    line = assert_one_line_error(tiderl("env", "serve", "--envs", "guess,nope"), 2)
    assert "nope" in line


def test_a_dead_owners_sessions_end_at_once_and_no_one_elses(server):
    async def scenario(client):
        mine = [await client.start("guess", "1 9", seed=i) for i in range(2)]
        client.owner = "rank-2"
        other = await client.start("guess", "1 9", seed=3)
        return mine, other
    async def main():
        async with HTTPEnvClient(server["url"], retries=1, owner="rank-1") as client:
            return await scenario(client)
    mine, other = asyncio.run(main())
    assert end_sessions_of(server["url"], "rank-1") == 2
    assert end_sessions_of(server["url"], "rank-1") == 0

    async def after(client):
        with pytest.raises(EnvClientError) as gone:
            await client.step(mine[0].session, "guess 1")
        assert gone.value.status == 404
        return await client.step(other.session, "guess 1")
    assert run(server, after).observation  # rank 2's session goes on
    with pytest.raises(EnvClientError, match="422"):
        end_sessions_of(server["url"], "")


def test_in_a_batch_a_fast_step_is_answered_before_a_slow_one():
    """Steps of one batch under a heavy-tailed latency model: each call comes back when its own
    step is done (the server streams the lines), not when the batch's slowest is."""
    config = EnvConfig(step_latency=LatencyConfig("lognormal", median_s=0.05, sigma=1.5))
    port = free_port()
    server = uvicorn.Server(uvicorn_config(build_app(config), "127.0.0.1", port,
                                           ConnectionLimits()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, lambda: None if thread.is_alive() else "the server's thread ended")

    async def timed_step(client, session):
        began = time.perf_counter()
        await client.step(session, "guess 5")
        return time.perf_counter() - began

    async def scenario(client):
        started = await asyncio.gather(*(client.start("guess", seed=i) for i in range(12)))
        return await asyncio.gather(*(timed_step(client, s.session) for s in started))

    try:
        took = run_env_scenario(url, scenario)
    finally:
        server.should_exit = True
        thread.join(10)
    assert max(took) > 0.2 and min(took) < max(took) / 4, took
