"""Tool-calling environments over the real `tiderl env serve`: messages and tools in /start, a
tool call answered by a tool message, the final answer scored; a user's ToolEnvironment and a
verifiers environment (stand-in, see tests/unit/test_env_verifiers.py) served by name."""

import json
from pathlib import Path

import httpx
import pytest

from tests.integration.serving import env_serving, run_env_scenario
from tiderl.env.calc import CalcEnv
from tiderl.env.client import Message

ROOT = Path(__file__).resolve().parents[2]
CAPITALS = "tests.unit.test_env_tools:CapitalEnv"
VERIFIERS = "verifiers:tests.unit.test_env_verifiers"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with env_serving(tmp_path_factory.mktemp("env-tools"), f"calc,guess,{CAPITALS},{VERIFIERS}",
                     "--max-sessions", "8", env={"PYTHONPATH": str(ROOT)}) as served:
        yield served


def run(server, scenario):
    return run_env_scenario(server["url"], scenario)


def test_calc_episode_with_the_scripted_solver_over_http(server):
    solver = CalcEnv()

    async def scenario(client):
        started = await client.start("calc", "3", seed=9)
        opening, info = solver.reset("3", 9)
        assert started.messages == opening and started.info == info
        assert started.observation == "\n".join(m.content for m in opening)
        assert [t["function"]["name"] for t in started.tools] == ["calculator"]
        action = solver.solve()
        assert "<tool_call>" in action
        tool = await client.step(started.session, action)
        expected = solver.step(action)
        assert tool.messages == expected.observation
        (message,) = tool.messages
        assert (message.role, message.tool_call_id, message.name) == (
            "tool", "call_0", "calculator")
        assert message.content == solver.task.answer == tool.observation
        assert not tool.done and tool.reward == 0.0
        final = await client.step(started.session, solver.solve())
        await client.end(started.session)
        return final

    final = run(server, scenario)
    assert final.done and final.reward == 1.0 and final.info["turns"] == 2


def test_the_wire_form_of_tool_messages_and_a_malformed_call(server):
    with httpx.Client(base_url=server["url"], timeout=5) as http:
        started = http.post("/start", json={"env": "calc", "seed": 1}).json()
        assert [m["role"] for m in started["messages"]] == ["system", "user"]
        assert started["tools"][0]["type"] == "function"
        bad = http.post("/observation", json={
            "session": started["session"],
            "action": '<tool_call>{"name": "calculator", "arguments": {</tool_call>'}).json()
        assert bad["messages"] == [{"role": "tool", "content": bad["observation"],
                                    "tool_call_id": "call_0"}]
        assert bad["observation"].startswith("error: malformed tool call")
        nameless = http.post("/observation", json={
            "session": started["session"],
            "action": f"<tool_call>{json.dumps({'arguments': {}})}</tool_call>"}).json()
        assert nameless["done"] is False
        assert nameless["messages"][0]["content"].startswith("error: malformed tool call")
        http.post("/end", json={"session": started["session"]})


def test_a_user_tool_environment_and_a_verifiers_environment_by_name(server):
    async def scenario(client):
        capital = await client.start(CAPITALS, "Japan")
        looked = await client.step(capital.session, '<tool_call>{"name": "lookup", '
                                                    '"arguments": {"country": "Japan"}}')
        won = await client.step(capital.session, "Tokyo.")
        vf = await client.start(VERIFIERS, "0")
        added = await client.step(vf.session, '<tool_call>{"name": "add", "arguments": '
                                              '{"a": 2, "b": 3}}</tool_call>')
        answered = await client.step(vf.session, "<answer>5</answer>")
        plain = await client.start("guess")
        for session in (capital.session, vf.session, plain.session):
            await client.end(session)
        return capital, looked, won, vf, added, answered, plain

    capital, looked, won, vf, added, answered, plain = run(server, scenario)
    assert capital.tools[0]["function"]["name"] == "lookup"
    assert looked.messages == [Message("tool", "Tokyo", tool_call_id="call_0", name="lookup")]
    assert won.done and won.reward == 1.0
    assert vf.messages[-1] == Message("user", "What is 2 + 3?") and vf.tools
    assert added.messages == [Message("tool", "5", tool_call_id="call_0")]
    assert answered.done and answered.reward == 1.0
    assert plain.messages == [Message("user", plain.observation)] and plain.tools == []


def test_the_server_is_alive_after_all_of_it(server):
    assert server["proc"].poll() is None
    assert "Traceback" not in server["log"].read_text()
