"""A real job (`run_local`, as `tiderl launch` runs it) on a tiny Qwen2 with the byte-level BPE and
chat template of `tiderl model init --tokenizer bpe`, playing the tool-calling `calc`
environment, whose prompts use words and symbols the word-level vocabulary lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiderl.launch.job import run_local
from tiderl.models.chat import ChatEncoder, turn_encoder
from tiderl.models.folder import load_tokenizer
from tiderl.models.loading import load_config
from tiderl.models.random_init import write_random_checkpoint
from tiderl.models.tokenizer import word_tokenizer
from tiderl.models.vocab import UNK
from tiderl.profile import load_profile

JOB = [
    "runtime.num_ranks=3", "runtime.rollout_ranks=1", "job.group_size=4",
    "job.batch_min_groups=1", "job.batch_groups=1", "env.envs=[calc]", "env.tasks={}",
    "env.options={}", "env.max_turns=3",
    "engine.max_new_tokens=24", "engine.kv_cache_tokens=4096", "runtime.heartbeat_s=0.5",
    "job.steps=2", "logging.rollouts=true", "report.plots=false",
]


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-bpe")
    write_random_checkpoint("tiny", folder, tokenizer="bpe")
    return folder


def run_two_steps(overrides: list[str], tmp_path: Path) -> tuple[list[dict], list[dict]]:
    """The job of ``overrides`` on the local profile: it ends well after its 2 steps, each with
    its reward recorded; its metrics and its episodes (logging.rollouts)."""
    result = run_local(load_profile("local", overrides), run_root=tmp_path)
    assert result.exit_code == 0, (result.run_dir / "logs" / "coordinator.log").read_text()[-3000:]
    metrics = _read(result.run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    assert all(m["reward_mean"] is not None for m in metrics)  # the reward is recorded
    episodes = [e for f in sorted((result.run_dir / "rollouts").glob("rank-*.jsonl"))
                for e in _read(f)]
    return metrics, episodes


def test_a_job_on_a_bpe_model_with_a_chat_template_plays_a_tool_environment(model, tmp_path):
    metrics, episodes = run_two_steps([*JOB, f"model.path={model}"], tmp_path)
    assert len(episodes) >= sum(m["trained_samples"] for m in metrics)
    encoder = turn_encoder(model, load_tokenizer(model), load_config(model).eos_token_id)
    assert isinstance(encoder, ChatEncoder)
    whole = [e for e in episodes if e["turns"] and e["transcript"]
             and e["transcript"][0].get("messages")]  # played on one rank from its start
    assert whole, "no episode was played from its start on one rank"
    for episode in whole:
        _check_episode(encoder, episode)


def _check_episode(encoder: ChatEncoder, episode: dict) -> None:
    """Each turn's prompt is what the engine counted, the ids only grow, and their text is the
    chat template applied to the episode's messages with the model's outputs between them."""
    first, *played = episode["transcript"]
    messages, tools = list(first["messages"]), first["tools"]
    words = word_tokenizer().encode(" ".join(m["content"] for m in first["messages"])).ids
    assert word_tokenizer().token_to_id(UNK) in words  # the word list lacks some of its words
    ids: list[int] = []
    generated = [entry for entry in played if "turn" in entry]
    answers = [entry["messages"] for entry in played if "messages" in entry]
    assert len(generated) == len(episode["turns"])
    for k, (turn, engine) in enumerate(zip(episode["turns"], generated, strict=True)):
        ids += turn["context_ids"]
        assert engine["prompt_tokens"] == len(ids)  # the engine received exactly this prompt
        assert engine["output_ids"] == turn["output_ids"]  # and generated exactly these
        ids += turn["output_ids"]
        output = turn["output_ids"]  # its text is the content, less an eos the closing ends it with
        closed = bool(output) and encoder.close_after(output) != encoder.closing
        content = encoder.hf.decode(output[:-1] if closed else output)
        messages.append({"role": "assistant", "content": content})
        if k + 1 < len(generated):  # the answer the next turn's context encodes
            messages += answers[k]
    text = encoder.hf.decode(ids) + encoder.close_after(episode["turns"][-1]["output_ids"])
    assert text == encoder.render(messages, tools, generation_prompt=False)
    assert UNK not in text
