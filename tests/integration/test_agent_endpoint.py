"""The agent endpoint (tiderl.env.agents, tiderl.env.agent_api) in a real environment service, the
job's own daemon (``python -m tiderl.runtime env``), with real agents on the real OpenAI and
Anthropic SDKs; the test plays the rollout rank over the environment protocol (HTTPEnvClient),
answering each model request with a completion it writes itself."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.serving import free_port, process_exit, stop_process, wait_healthy
from tiderl.env.client import EnvClientError, HTTPEnvClient
from tiderl.env.protocol import Completion
from tiderl.models.bpe import IM_END, train_bpe, write_tokenizer_files
from tiderl.models.folder import load_tokenizer
from tiderl.profile import build_profile, profile_to_dict

HERE = Path(__file__).parent
WAIT_S = 120.0  # an agent's start or step: follows the agent, bounded by its deadline
AGENTS = {
    "calc-openai": {"entry": "tiderl.examples.calc_openai:run"},
    "calc-anthropic": {"entry": "tiderl.examples.calc_anthropic:run"},
    "calc-cli": {"command": f"{sys.executable} -m tiderl.examples.calc_cli"},
    "streams": {"entry": "agents_for_tests:streams"},
    "anthropic-streams": {"entry": "agents_for_tests:anthropic_streams"},
    "trims": {"entry": "agents_for_tests:trims"},
    "tokens-in": {"entry": "agents_for_tests:tokens_in"},
    "names-a-session": {"entry": "agents_for_tests:names_a_session"},
    "renders": {"entry": "agents_for_tests:renders"},
    "hold": {"entry": "agents_for_tests:hold"},
    "raises": {"entry": "agents_for_tests:raises"},
    "silent": {"entry": "agents_for_tests:silent"},
    "sleeps": {"entry": "agents_for_tests:sleeps"},
    "exits": {"command": f"{sys.executable} -c 'import sys; sys.exit(3)'"},
}


@contextlib.contextmanager
def agent_service(root: Path, agents: dict, timeout_s: float = 600.0,
                  ) -> Iterator[tuple[str, subprocess.Popen]]:
    """The job's environment daemon serving ``agents`` (agent_timeout_s ``timeout_s``); yields
    its URL and process, stopped at the end (SIGTERM, SIGKILL after a grace period)."""
    root.mkdir(parents=True, exist_ok=True)
    profile = build_profile({"env": {"envs": list(agents), "agents": agents,
                                     "agent_timeout_s": timeout_s}})
    (root / "profile.yaml").write_text(yaml.safe_dump(profile_to_dict(profile)))
    port, log = free_port(), root / "env.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tiderl.runtime", "env", "--run-dir", str(root), "--port",
             str(port)], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])})
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, process_exit(proc, log))
            yield url, proc
        finally:
            stop_process(proc)


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Iterator[str]:
    with agent_service(tmp_path_factory.mktemp("agents"), AGENTS) as (url, _):
        yield url


def play(url: str, scenario):
    async def main():
        async with HTTPEnvClient(url, retries=0) as client:
            return await scenario(client)
    return asyncio.run(main())


def done(ids: list[int], prompt: int = 10) -> Completion:
    return Completion(ids, [-0.5] * len(ids), "stop", prompt)


def call_text(expression: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"I will compute.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"


@pytest.mark.parametrize("agent", ["calc-openai", "calc-anthropic", "calc-cli"])
def test_a_calc_agent_plays_a_task_turn_by_turn_through_its_sdk(service, agent):
    async def scenario(client):
        start = await client.start(agent, "2", 7, task_id=f"calc-{agent}", wait_s=WAIT_S)
        assert start.agent and [m.role for m in start.messages] == ["system", "user"]
        assert start.tools[0]["function"]["name"] == "calculator"
        expression = re.search(r"What is (.*)\?", start.observation).group(1)
        tool = await client.step(start.session, call_text(expression), done([11, 12]),
                                 wait_s=WAIT_S)
        # the agent ran the tool and sent the conversation back with the result: an extension,
        # whose new message alone goes to the rank
        assert not tool.done and not tool.restart
        assert [(m.role, m.tool_call_id) for m in tool.messages] == [("tool", "call_0_0")]
        value = tool.messages[0].text()
        end = await client.step(start.session, f"<answer>{value}</answer>", done([13]),
                                wait_s=WAIT_S)
        await client.end(start.session)
        return end
    end = play(service, scenario)
    assert end.done and end.reward == 1.0 and end.info["agent_segments"] == 1


def test_a_streamed_conversation_is_answered_in_sse_chunks_with_usage(service):
    async def scenario(client):
        start = await client.start("streams", wait_s=WAIT_S)
        second = await client.step(start.session, "one", done([1, 2]), wait_s=WAIT_S)
        end = await client.step(start.session, "two", done([3, 4]), wait_s=WAIT_S)
        return second, end
    second, end = play(service, scenario)
    assert not second.restart and [m.text() for m in second.messages] == ["more"]
    assert end.done and end.reward == 1.0  # the agent checked the texts and the usage chunk


def test_an_anthropic_stream_is_the_sdk_s_events_and_count_tokens_answers(service):
    async def scenario(client):
        start = await client.start("anthropic-streams", wait_s=WAIT_S)
        return await client.step(start.session, "one", done([1, 2]), wait_s=WAIT_S)
    end = play(service, scenario)
    assert end.done and end.reward == 1.0  # the agent checked the text, the usage, the count


def test_a_history_that_does_not_extend_the_last_request_is_a_new_segment(service):
    async def scenario(client):
        start = await client.start("trims", wait_s=WAIT_S)
        second = await client.step(start.session, "short", done([1]), wait_s=WAIT_S)
        end = await client.step(start.session, "ok", done([2]), wait_s=WAIT_S)
        return second, end
    second, end = play(service, scenario)
    assert second.restart and [m.text() for m in second.messages] == ["summary: short"]
    assert end.reward == 0.5 and end.info["agent_segments"] == 2


def test_token_in_requests_extend_by_ids_and_answer_in_vllm_s_schema(service):
    async def scenario(client):
        start = await client.start("tokens-in", wait_s=WAIT_S)
        second = await client.step(start.session, "", done([20, 21], 3), wait_s=WAIT_S)
        end = await client.step(start.session, "", done([22], 6), wait_s=WAIT_S)
        return start, second, end
    start, second, end = play(service, scenario)
    assert start.prompt_ids == [5, 6, 7] and start.sampling == {"max_tokens": 4}
    assert not second.restart and second.prompt_ids == [9]  # prompt + output ids + the new one
    assert end.done and end.reward == 1.0


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bpe")
    write_tokenizer_files(train_bpe(), folder)
    return folder


def test_a_session_id_the_task_named_routes_requests_at_the_root_without_its_key(service):
    async def scenario(client):
        start = await client.start("names-a-session", wait_s=WAIT_S)
        return start, await client.step(start.session, "", done([1, 2], 2), wait_s=WAIT_S)
    start, end = play(service, scenario)
    assert start.prompt_ids == [5, 6]
    assert end.done and end.reward == 1.0


def test_verifiers_token_in_client_code_drives_a_task_turn_by_turn(service, bpe_folder):
    """``renderers.client.generate``, the call verifiers v1's TrainClient makes, with its own
    trace id in X-Session-ID. Its second turn, re-rendered whole (the default renderer does not
    bridge), does not start with the sampled ids (the template writes the call its own way): a
    new segment, rendered as the client sent it."""
    tokenizer = load_tokenizer(bpe_folder)
    call = {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    calling = tokenizer.encode(f"<tool_call>\n{json.dumps(call)}\n</tool_call>{IM_END}").ids
    answering = tokenizer.encode(f"5{IM_END}").ids

    async def scenario(client):
        start = await client.start("renders", str(bpe_folder), wait_s=WAIT_S)
        second = await client.step(start.session, "", done(calling, len(start.prompt_ids)),
                                   wait_s=WAIT_S)
        end = await client.step(start.session, "", done(answering), wait_s=WAIT_S)
        return start, second, end
    start, second, end = play(service, scenario)
    assert tokenizer.decode(start.prompt_ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n")
    assert second.restart
    text = tokenizer.decode(second.prompt_ids, skip_special_tokens=False)
    assert text.startswith(tokenizer.decode(start.prompt_ids, skip_special_tokens=False))
    assert "<tool_response>\n5\n</tool_response>" in text
    assert end.done and end.reward == 1.0  # it parsed our ids into the call and the answer


@contextlib.asynccontextmanager
async def held_task(client: HTTPEnvClient, tmp_path: Path, name: str):
    """A task whose agent is the test: yields (where it is served, the pending start)."""
    where = tmp_path / f"{name}.json"
    starting = asyncio.ensure_future(client.start("hold", str(where), task_id=name,
                                                  wait_s=WAIT_S))
    while not where.exists():
        assert not starting.done(), starting.result()
        await asyncio.sleep(0.05)
    try:
        yield json.loads(where.read_text()), starting
    finally:
        starting.cancel()


def chat_body(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_bad_requests_get_one_line_errors_in_the_sdk_shape_and_the_task_goes_on(
        service, tmp_path):
    async def scenario(client):
        async with held_task(client, tmp_path, "errs") as (task, starting), \
                held_task(client, tmp_path, "other") as (other, _), \
                httpx.AsyncClient(base_url=service, timeout=WAIT_S) as http:
            key = {"Authorization": f"Bearer {task['key']}"}
            path = "/tasks/errs/v1/chat/completions"
            answers = {
                "no key": await http.post(path, json=chat_body()),
                "wrong key": await http.post(path, json=chat_body(), headers={
                    "Authorization": f"Bearer {other['key']}"}),
                "unknown task": await http.post("/tasks/nope/v1/chat/completions",
                                                json=chat_body(), headers=key),
                "malformed": await http.post(path, content=b"{not json", headers=key),
                "n": await http.post(path, json=chat_body(n=2), headers=key),
                "unsupported": await http.post(path, json=chat_body(logit_bias={}), headers=key),
                "anthropic": await http.post("/tasks/errs/v1/messages", headers={
                    "x-api-key": task["key"]}, json={"model": "m", "messages": []}),
            }
            # the task is still served: a good request reaches the rank and is answered
            asking = asyncio.ensure_future(http.post(path, json=chat_body(), headers=key))
            start = await starting
            stepping = asyncio.ensure_future(client.step(start.session, "hello", done([1]),
                                                         wait_s=WAIT_S))
            answer = await asyncio.wait_for(asyncio.shield(asking), WAIT_S)
            models = await http.get("/v1/models", headers={"x-api-key": task["key"]})
            await http.post("/tasks/errs/finish", headers=key)
            end = await stepping
            late = await http.post(path, json=chat_body(), headers=key)
            return answers, answer, models, end, late
    answers, answer, models, end, late = play(service, scenario)
    assert {name: r.status_code for name, r in answers.items()} == {
        "no key": 401, "wrong key": 401, "unknown task": 404, "malformed": 400, "n": 400,
        "unsupported": 400, "anthropic": 400}
    assert "logit_bias" in answers["unsupported"].json()["error"]["message"]
    assert answers["anthropic"].json()["type"] == "error"
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == "hello"
    assert answer.json()["usage"]["completion_tokens"] == 1
    assert models.json()["data"][0]["max_model_len"] > 0
    assert end.done and late.status_code == 409


def test_an_sdk_retry_of_a_request_is_answered_once(service, tmp_path):
    async def scenario(client):
        async with held_task(client, tmp_path, "retry") as (task, starting), \
                httpx.AsyncClient(base_url=service, timeout=WAIT_S) as http:
            path = "/tasks/retry/v1/chat/completions"
            key = {"Authorization": f"Bearer {task['key']}"}
            first = asyncio.ensure_future(http.post(path, json=chat_body(), headers=key))
            start = await starting
            retried = asyncio.ensure_future(http.post(path, json=chat_body(), headers={
                **key, "x-stainless-retry-count": "1"}))
            await asyncio.sleep(0.2)
            stepping = asyncio.ensure_future(client.step(start.session, "once", done([1]),
                                                         wait_s=WAIT_S))
            answers = [await first, await retried]
            again = asyncio.ensure_future(http.post(path, json=chat_body(seed=1), headers=key))
            nxt = await stepping  # the next request the rank sees is the new one, not the retry
            await client.end(start.session)
            return answers, nxt, await again
    answers, nxt, again = play(service, scenario)
    assert [a.json()["choices"][0]["message"]["content"] for a in answers] == ["once", "once"]
    # the same question again without the answer: not an extension, so a new segment
    assert nxt.restart and nxt.sampling == {"seed": 1}
    assert again.status_code == 409  # its task ended before the rank answered it


@pytest.mark.parametrize("agent, reason", [
    ("raises", 'the agent raised RuntimeError: "the agent\'s own bug"'),
    ("silent", "the agent ended without calling the model"),
    ("exits", "the agent exited with code 3"),
])
def test_an_agent_that_fails_fails_its_task_with_the_reason(service, agent, reason):
    async def scenario(client):
        with pytest.raises(EnvClientError) as failed:
            await client.start(agent, wait_s=WAIT_S)
        return failed.value
    error = play(service, scenario)
    assert error.status == 422 and reason in str(error)


def test_an_agent_past_its_deadline_is_stopped_and_its_task_fails(tmp_path):
    with agent_service(tmp_path / "svc", {"sleeps": AGENTS["sleeps"]},
                       timeout_s=1.0) as (url, _):
        async def scenario(client):
            with pytest.raises(EnvClientError) as failed:
                await client.start("sleeps", wait_s=WAIT_S)
            return failed.value, await client.health()
        error, health = play(url, scenario)
    assert error.status == 422 and "passed its deadline (1 s" in str(error)
    assert health["sessions"] == 0  # its session went with it


def test_the_service_stops_on_sigterm_while_an_agent_and_the_rank_wait(tmp_path):
    """A /start waiting for its agent's first request (the agent works on), the rank's
    connection gone: SIGTERM ends the service (its waiting requests are ended, not awaited),
    without the SIGKILL that follows a grace period."""
    with agent_service(tmp_path / "svc", {"hold": AGENTS["hold"]}) as (url, proc):
        async def scenario(client):
            async with held_task(client, tmp_path, "waits"):
                pass  # the rank gives up its /start; the agent holds on
        play(url, scenario)
        stop_process(proc)
    assert proc.returncode != -signal.SIGKILL
