"""Turn-by-turn encoding through a chat template (tiderl.models.chat) with the byte-level BPE of
`tiderl model init --tokenizer bpe`: the ids built turn by turn keep every output id as sampled
and their text is the template applied to the whole conversation."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiderl.engine.config import EngineConfig
from tiderl.engine.scheduler import Scheduler
from tiderl.models.bpe import ENDOFTEXT, IM_END, TOOL_TAGS, train_bpe, write_tokenizer_files
from tiderl.models.chat import ChatEncoder, PlainEncoder, turn_encoder
from tiderl.models.folder import ModelLoadError, load_tokenizer
from tiderl.models.loading import load_config
from tiderl.models.tokenizer import word_tokenizer

TURNS = 10
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    write_tokenizer_files(train_bpe(), out)
    return out


@pytest.fixture(scope="module")
def encoder(folder) -> ChatEncoder:
    eos = load_config_eos(folder)
    chat = turn_encoder(folder, load_tokenizer(folder), eos)
    assert isinstance(chat, ChatEncoder)
    return chat


def load_config_eos(folder) -> tuple[int, ...]:
    return tuple(json.loads((folder / "generation_config.json").read_text())["eos_token_id"])


text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=40)
answer = st.lists(st.sampled_from(["hello", " world", "Zyx", "qwerty", "391", " ", "é", "火",
                                   "\n", "<tool_call>", "{\"a\": 1}", "</tool_call>"]),
                  max_size=8)
reply = st.one_of(
    st.builds(lambda c: [{"role": "user", "content": c}], text),
    st.builds(lambda c, d: [{"role": "tool", "content": c, "tool_call_id": "call_0",
                             "name": "calculator"},
                            {"role": "tool", "content": d, "tool_call_id": "call_1",
                             "name": "calculator"}], text, text))


@settings(max_examples=40, deadline=None)
@given(first=text, system=st.booleans(), tools=st.booleans(),
       turns=st.lists(st.tuples(answer, st.booleans(), reply), min_size=TURNS, max_size=TURNS))
def test_ids_built_turn_by_turn_are_the_whole_conversation_and_keep_every_output(
        encoder, first, system, tools, turns):
    messages = ([{"role": "system", "content": "Play."}] if system else []) + [
        {"role": "user", "content": first}]
    schemas = TOOLS if tools else []
    ids = encoder.opening(first, messages, schemas)
    outputs = []
    for pieces, ends_with_eos, answer_messages in turns:
        # a sampled output need not be the canonical encoding of its text: pieces encoded apart
        output = [i for piece in pieces for i in encoder.encode(piece)]
        output += [encoder.hf.convert_tokens_to_ids(IM_END)] * ends_with_eos
        outputs.append((len(ids), output))
        ids += output
        before = list(ids)
        ids += encoder.following("", answer_messages, output)
        assert ids[:len(before)] == before  # append-only
        content = encoder.hf.decode([i for i in output if i not in encoder.eos_ids])
        messages += [{"role": "assistant", "content": content}, *answer_messages]
    assert encoder.hf.decode(ids) == encoder.render(messages, schemas)
    for at, output in outputs:
        assert ids[at:at + len(output)] == output  # the loss covers exactly these


def test_encoding_the_whole_conversation_again_would_change_the_models_ids(encoder):
    """Why the encoder never re-encodes: a word sampled as two pieces is not how the word
    encodes (the longest letters-only token of the vocabulary, split after 2 letters)."""
    word = max((t for t in encoder.hf.get_vocab() if t.isascii() and t.isalpha()), key=len)
    messages = [{"role": "user", "content": f"say {word}"}]
    ids = encoder.opening("", messages, [])
    output = encoder.encode(word[:2]) + encoder.encode(word[2:])
    assert len(encoder.encode(word)) == 1 and output != encoder.encode(word)
    ids += [*output, encoder.hf.convert_tokens_to_ids(IM_END)]
    ids += encoder.following("", [{"role": "user", "content": "again"}], ids[-len(output) - 1:])
    whole = [*messages, {"role": "assistant", "content": word},
             {"role": "user", "content": "again"}]
    again = encoder.encode(encoder.render(whole))
    assert encoder.hf.decode(ids) == encoder.hf.decode(again)
    assert ids != again


def test_the_turn_closes_with_the_templates_closing_less_the_sampled_eos(encoder):
    im_end = encoder.hf.convert_tokens_to_ids(IM_END)
    assert encoder.closing == IM_END + "\n"
    assert encoder.close_after([5, im_end]) == "\n"
    assert encoder.close_after([5, 6]) == IM_END + "\n"  # cut at max_tokens: closed for it
    endoftext = encoder.hf.convert_tokens_to_ids(ENDOFTEXT)
    assert encoder.close_after([5, endoftext]) == IM_END + "\n"


def test_decoding_keeps_tool_tags_and_drops_the_eos(encoder):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'
    ids = [*encoder.encode(call), encoder.hf.convert_tokens_to_ids(IM_END)]
    assert encoder.decode(ids) == call
    assert all(len(encoder.encode(tag)) == 1 for tag in TOOL_TAGS)


def test_words_outside_the_word_list_encode_and_decode(encoder):
    line = "The quokka juggles 12 kumquats — très bien!"
    assert word_tokenizer().decode(word_tokenizer().encode(line).ids) != line.lower()
    assert encoder.hf.decode(encoder.encode(line)) == line


def test_a_folder_without_a_template_or_with_it_turned_off_encodes_plain_text(folder, tmp_path):
    word_tokenizer().save(str(tmp_path / "tokenizer.json"))
    assert isinstance(turn_encoder(tmp_path, word_tokenizer(), [1]), PlainEncoder)
    assert isinstance(turn_encoder(folder, load_tokenizer(folder), [2], use_template=False),
                      PlainEncoder)
    assert isinstance(turn_encoder(None, word_tokenizer(), [1]), PlainEncoder)
    plain = PlainEncoder(word_tokenizer())
    assert plain.opening("higher .", [{"role": "user", "content": "ignored"}], []) == \
        word_tokenizer().encode("higher .").ids


def test_the_eos_set_joins_generation_config_and_ends_a_generation(tmp_path):
    from tiderl.models.random_init import write_random_checkpoint

    write_random_checkpoint("tiny", tmp_path, tokenizer="bpe")
    config = load_config(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    eos = (tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT))
    assert config.eos_token_id == eos
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_config(tmp_path).eos_token_id == (*eos, 7)
    scheduler = Scheduler(EngineConfig(kv_cache_tokens=256), load_config(tmp_path).eos_token_id)
    assert scheduler.eos_token_ids == {*eos, 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ModelLoadError, match=r"generation_config\.json"):
        load_config(tmp_path)
