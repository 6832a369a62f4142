"""Messages and tool calls: the protocol types, the Hermes / Qwen2.5 parser, the tool loop of
ToolEnvironment and the calc environment, on CPU."""

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiderl.env.base import observation_messages, observation_text
from tiderl.env.calc import CalcEnv, evaluate, read_number
from tiderl.env.protocol import Message, StartResponse, ToolCall, ToolFunction
from tiderl.env.registry import make_env
from tiderl.env.tools import (
    MAX_TOOL_CALLS,
    ToolEnvironment,
    ToolTask,
    assistant_message,
    parse_tool_calls,
    run_tool_call,
)


def call_text(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# -- protocol types --------------------------------------------------------------------------

def test_messages_encode_as_openai_messages_and_check_roles_and_fields():
    call = ToolCall("call_0", ToolFunction("calculator", '{"expression": "1+1"}'))
    assert msgspec.to_builtins(Message("assistant", tool_calls=[call])) == {
        "role": "assistant", "tool_calls": [{"id": "call_0", "type": "function", "function": {
            "name": "calculator", "arguments": '{"expression": "1+1"}'}}]}
    assert msgspec.to_builtins(Message("tool", "2", tool_call_id="call_0", name="calculator")) \
        == {"role": "tool", "content": "2", "tool_call_id": "call_0", "name": "calculator"}
    with pytest.raises(ValueError, match="role"):
        Message("bot", "hi")
    with pytest.raises(ValueError, match="tool_calls"):
        Message("user", "hi", tool_calls=[call])
    with pytest.raises(ValueError, match="tool_call_id"):
        Message("assistant", "hi", tool_call_id="call_0")
    with pytest.raises(msgspec.ValidationError, match="role"):
        msgspec.json.decode(b'{"role": "bot"}', type=Message)


def test_an_old_start_answer_decodes_with_empty_messages_and_tools():
    out = msgspec.json.decode(b'{"session": "s1", "observation": "hi"}', type=StartResponse)
    assert (out.messages, out.tools) == ([], [])


def test_observations_have_both_forms():
    assert observation_messages("higher .") == [Message("user", "higher .")]
    assert observation_text("higher .") == "higher ."
    messages = [Message("system", "be brief"), Message("user", "what is 2 + 2?")]
    assert observation_text(messages) == "be brief\nwhat is 2 + 2?"
    assert observation_messages(messages) == messages
    with pytest.raises(TypeError, match="Message"):
        observation_messages([{"role": "user", "content": "x"}])


# -- the parser ------------------------------------------------------------------------------

def test_several_calls_are_read_in_order_with_positional_ids():
    text = ("Let me compute. " + call_text("calculator", expression="17 * 23")
            + "\n" + call_text("lookup", key="a", n=2) + " done")
    calls = parse_tool_calls(text)
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("call_0", "calculator", {"expression": "17 * 23"}), ("call_1", "lookup",
                                                               {"key": "a", "n": 2})]
    assert all(c.type == "function" for c in calls)
    message = assistant_message(text)
    assert message.content == "Let me compute. \n done"
    assert message.tool_calls == calls


def test_no_call_gives_an_empty_list_and_a_plain_assistant_message():
    assert parse_tool_calls("the answer is 4") == []
    assert parse_tool_calls("") == []
    assert assistant_message("4") == Message("assistant", "4")


@pytest.mark.parametrize("body", ['{"name": "calculator", "arguments": {"expression": "1+"',
                                  "not json at all", '["calculator"]', '{"arguments": {}}',
                                  '{"name": 3}', '{"name": ""}', "[" * 5000])
def test_a_malformed_call_keeps_its_text_and_becomes_an_error_tool_message(body):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert (call.id, call.function.name, call.function.arguments) == ("call_0", "", body)
    answer = run_tool_call(call, {"calculator": evaluate})
    assert answer.role == "tool" and answer.tool_call_id == "call_0" and answer.name is None
    assert answer.content.startswith("error: malformed tool call")


def test_an_unclosed_call_and_string_or_parameters_arguments_are_read():
    calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}'
                             '<tool_call>{"name": "b", "parameters": {"y": 2}}')
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("a", '{"x": 1}'), ("b", '{"y": 2}')]
    (call,) = parse_tool_calls('<tool_call>{"name": "c"}')
    assert call.function.arguments == "{}"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>/{}[]":, tool_calnmeargsx\n')), max_size=120))
def test_the_parser_never_raises(text):
    for call in parse_tool_calls(text):
        assert isinstance(call.function.arguments, str)
        run_tool_call(call, {"x": lambda **kw: "ok"})


def test_tool_errors_are_tool_messages():
    def boom(expression: str) -> str:
        raise RuntimeError("no battery")
    functions = {"calculator": boom}
    cases = {
        call_text("calculator", expression="1"): "error: calculator failed: RuntimeError: no "
                                                 "battery",
        call_text("abacus", beads=3): "error: unknown tool 'abacus'; the tools are calculator",
        call_text("calculator", wrong=1): "error: calculator failed: TypeError",
        '<tool_call>{"name": "calculator", "arguments": "[1, 2]"}</tool_call>':
            "error: the arguments of calculator are not a JSON object",
    }
    for text, expected in cases.items():
        (call,) = parse_tool_calls(text)
        assert run_tool_call(call, functions).content.startswith(expected), text


# -- ToolEnvironment, with a user's environment ------------------------------------------------

LOOKUP_SCHEMA = {"type": "function", "function": {
    "name": "lookup", "description": "The capital of a country.",
    "parameters": {"type": "object", "properties": {"country": {"type": "string"}},
                   "required": ["country"]}}}
CAPITALS = {"france": "Paris", "japan": "Tokyo", "peru": "Lima"}


class CapitalEnv(ToolEnvironment):
    """A user's tool environment: OpenAI conventions, any reply without a call is final."""

    tool_schemas = (LOOKUP_SCHEMA,)
    system_prompt = "Answer with the capital."
    answer_tag = None

    def tool_functions(self):
        return {"lookup": lambda country: CAPITALS[country.lower()]}

    def make_task(self, task, seed):
        country = task or sorted(CAPITALS)[seed % len(CAPITALS)]
        return ToolTask(f"What is the capital of {country}?", CAPITALS[country.lower()])

    def score(self, answer, task):
        return float(task.answer.lower() in answer.lower())


def test_a_user_tool_environment_runs_the_openai_loop():
    env = make_env("tests.unit.test_env_tools:CapitalEnv", max_turns=4)
    opening, _ = env.reset("Peru", seed=0)
    assert opening == [Message("system", "Answer with the capital."),
                       Message("user", "What is the capital of Peru?")]
    assert env.tools == [LOOKUP_SCHEMA]
    looked = env.step(call_text("lookup", country="Peru") + call_text("lookup", country="Mars"))
    assert [(m.role, m.tool_call_id, m.name) for m in looked.observation] == [
        ("tool", "call_0", "lookup"), ("tool", "call_1", "lookup")]
    assert looked.observation[0].content == "Lima"
    assert looked.observation[1].content == "error: lookup failed: KeyError: 'mars'"
    assert not looked.done and looked.info["tool_calls"] == 2
    final = env.step("It is Lima.")
    assert (final.reward, final.done, final.info["turns"]) == (1.0, True, 2)
    assert env.step("more").done


def test_the_turn_cap_ends_a_tool_episode_with_zero_reward():
    env = CapitalEnv(max_turns=2)
    env.reset(None, 1)
    first = env.step(call_text("lookup", country="Japan"))
    last = env.step(call_text("lookup", country="Japan"))
    assert not first.done and last.done and last.reward == 0.0 and last.info["truncated"]


def test_calls_past_the_per_turn_limit_are_not_run():
    env = CapitalEnv()
    env.reset(None, 0)
    out = env.step(call_text("lookup", country="France") * (MAX_TOOL_CALLS + 2))
    assert len(out.observation) == MAX_TOOL_CALLS + 2
    assert out.info["tool_calls"] == MAX_TOOL_CALLS
    assert out.observation[-1].content.startswith(f"error: at most {MAX_TOOL_CALLS}")


def test_schemas_and_functions_must_match():
    class Mismatched(CapitalEnv):
        def tool_functions(self):
            return {"search": print}
    with pytest.raises(ValueError, match="differ"):
        Mismatched()


# -- calc -----------------------------------------------------------------------------------

def test_calc_scripted_episode_and_a_wrong_answer():
    env = CalcEnv()
    opening, info = env.reset("2", seed=11)
    assert [m.role for m in opening] == ["system", "user"]
    assert info["expression"] in opening[1].content
    assert [t["function"]["name"] for t in env.tools] == ["calculator"]
    tool = env.step(env.solve())
    (message,) = tool.observation
    assert message.role == "tool" and message.content == env.task.answer
    assert env.solve() == f"<answer>{env.task.answer}</answer>"
    assert env.step(env.solve()).reward == 1.0
    env.reset("2", seed=11)
    wrong = env.step(f"<answer>{int(env.task.answer) + 1}</answer>")
    assert wrong.done and wrong.reward == 0.0


def test_calc_asks_for_a_call_or_an_answer_and_reads_lenient_numbers():
    env = CalcEnv()
    env.reset(None, 0)
    nudge = env.step("I think it is big")
    assert not nudge.done and "No tool call and no <answer>" in nudge.observation[0].content
    assert env.score(f" {env.task.answer}.0 ", env.task) == 1.0
    assert read_number("1,391") == 1391.0 and read_number("-12") == -12.0
    assert read_number("none") is None


def test_calc_tasks_set_the_number_of_operators():
    for ops in (1, 2, 3, 4):
        env = CalcEnv()
        env.reset(f"ops {ops}", seed=5)
        assert sum(tok in "+-*" for tok in env.task.info["expression"].split()) == ops


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "a + 1", "[1, 2]",
                                        "2 ** 65", "9 ** 9 ** 9", "1 / 0", "(-8) ** 0.5",
                                        "1e400", "10 ** 29 * 10", "x" * 300, "lambda: 1",
                                        "True + 1", "'1' * 3"])
def test_the_calculator_refuses_anything_but_arithmetic(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


def test_the_calculator_evaluates_arithmetic():
    assert evaluate("(17 * 23) + 4") == 395
    assert evaluate("7 // 2 + 7 % 2 - -1") == 5
    assert evaluate("2 ** 10 / 4") == 256.0
