"""Token fidelity of agent tasks (tiderl.env.agents.Conversation with the rank's turn encoding,
tiderl.models.chat): over random multi-turn conversations with tool calls, as an SDK agent sends
them back, the trained ids are the chat template applied to the conversation, every output keeps
its sampled ids, and each history that does not extend the last request opens exactly one new
segment."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiderl.env.agent_wire import parse_chat
from tiderl.env.agents import Conversation, ModelRequest
from tiderl.env.protocol import Completion
from tiderl.env.tools import answer_message
from tiderl.models.bpe import IM_END, train_bpe, write_tokenizer_files
from tiderl.models.chat import ChatEncoder, turn_encoder
from tiderl.models.folder import load_tokenizer
from tiderl.runtime.agent import _plain, cut_at_stop

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory) -> ChatEncoder:
    folder = tmp_path_factory.mktemp("bpe")
    write_tokenizer_files(train_bpe(), folder)
    eos = tuple(json.loads((folder / "generation_config.json").read_text())["eos_token_id"])
    chat = turn_encoder(folder, load_tokenizer(folder), eos)
    assert isinstance(chat, ChatEncoder)
    return chat


def call_block(expression: str) -> str:
    return ("<tool_call>\n" + json.dumps({"name": "calculator",
                                          "arguments": {"expression": expression}})
            + "\n</tool_call>")


words = st.sampled_from(["Let me see.", " 17 * 23", "火", "é", "done", "\n", "ok "])
output = st.tuples(st.lists(words, max_size=4), st.lists(st.sampled_from(["1+2", "3 * 4"]),
                                                          max_size=2), st.booleans())
# what the agent does after an answer: go on (tool results, or a user line), or rewrite its
# history (drop the oldest exchange, or edit the last answer): not an extension
move = st.sampled_from(["go on", "go on", "go on", "trim", "edit"])


def sdk_echo(message) -> dict:
    """The answer as an OpenAI SDK agent appends it to its messages (model_dump)."""
    out: dict = {"role": "assistant", "content": message.text() or None}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls]
    return out


@settings(max_examples=30, deadline=None)
@given(turns=st.lists(st.tuples(output, move), min_size=2, max_size=8))
def test_agent_turns_train_the_template_of_the_conversation_and_keep_every_output(
        encoder, turns):
    asyncio.run(_play(encoder, turns))


async def _play(encoder: ChatEncoder, turns) -> None:
    conversation = Conversation()
    history = [{"role": "system", "content": "Compute."}, {"role": "user", "content": "q0"}]
    trained = list(history)  # the conversation as the segment's ids render it
    segment: list[int] = []
    last_output: list[int] = []
    rewrites, rewrote = 0, False
    for k, ((pieces, calls, eos), then) in enumerate(turns):
        messages, tools, sampling = parse_chat({"messages": history, "tools": TOOLS})
        turn = conversation.turn(ModelRequest(messages, tools, None, sampling, ""))
        if turn.restart:
            trained = _plain(turn.messages)
            segment = encoder.opening("", trained, turn.tools)
        else:
            segment += encoder.following("", _plain(turn.messages), last_output)
        # the ids the model reads are the template of the conversation so far
        assert encoder.hf.decode(segment) == encoder.render(trained, TOOLS)
        sampled = [i for piece in [*pieces, *map(call_block, calls)]
                   for i in encoder.encode(piece)]  # not the canonical encoding of the text
        sampled += [encoder.hf.convert_tokens_to_ids(IM_END)] * eos
        before = list(segment)
        segment += sampled
        assert segment[:len(before)] == before and segment[len(before):] == sampled
        last_output = sampled
        message = answer_message(encoder.decode(sampled), f"call_{k}_")
        conversation.answered(ModelRequest(messages, tools, None, sampling, ""),
                              Completion(sampled, [0.0] * len(sampled)), message)
        history.append(sdk_echo(message))
        trained.append({"role": "assistant",
                        "content": encoder.hf.decode([i for i in sampled
                                                      if i not in encoder.eos_ids])})
        rewrote = then == "edit" or (then == "trim" and len(history) > 3)
        if then == "trim" and rewrote:
            del history[1:3]  # the oldest question and its answer: a summarised history
        elif then == "edit":
            history[-1] = {"role": "assistant", "content": f"edited {k}"}
        rewrites += rewrote
        new = [{"role": "tool", "tool_call_id": c.id, "content": f"r{k}{i}"}
               for i, c in enumerate(message.tool_calls or ())] or \
            [{"role": "user", "content": f"q{k + 1}"}]
        history += new
        trained += new
    # the agent's next request: one segment to start with, one per rewrite of the history
    messages, tools, sampling = parse_chat({"messages": history, "tools": TOOLS})
    last = conversation.turn(ModelRequest(messages, tools, None, sampling, ""))
    assert last.restart == rewrote  # an extension unless the last answer was rewritten
    assert conversation.num_segments == 1 + rewrites


def test_a_stop_string_cuts_the_output_at_the_token_that_completes_it(encoder):
    sampled = [i for piece in ["The value", " is 7", "END and more"]
               for i in encoder.encode(piece)]
    ids, logprobs, text, stop = cut_at_stop(encoder.decode, sampled, [-1.0] * len(sampled),
                                            ["END", "never"])
    assert stop == "END" and text == "The value is 7"
    assert encoder.decode(ids).startswith("The value is 7END")
    assert not encoder.decode(ids[:-1]).startswith("The value is 7END")
    assert ids == sampled[:len(ids)] and len(logprobs) == len(ids)
    assert cut_at_stop(encoder.decode, sampled, [0.0] * len(sampled), ["zzz"])[3] == ""
