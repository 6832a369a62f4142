"""A real job (`run_local`, as `tiderl launch` runs it) on a tiny Qwen2-VL with the byte-level
BPE and chat template of `tiderl model init --size tiny-vl --tokenizer bpe`, playing the `gui`
environment: screenshots enter the model as images, the screenshot window prunes each context
and the trainer trains the segments it cuts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_chat_job import JOB as CHAT_JOB
from tests.e2e.test_chat_job import run_two_steps
from tiderl.models.random_init import write_random_checkpoint

# the tool job's layout and length, on the gui screens, with a window that prunes 5-turn tasks
JOB = [*CHAT_JOB, "env.envs=[gui]", "env.max_turns=5", "env.image_window.limit=3",
       "env.image_window.keep=2", "engine.max_new_tokens=10"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-vl")
    write_random_checkpoint("tiny-vl", folder, tokenizer="bpe")
    return folder


def test_a_job_on_a_vl_model_plays_the_gui_environment_and_trains_segments(model, tmp_path):
    metrics, episodes = run_two_steps([*JOB, f"model.path={model}"], tmp_path)
    assert episodes and all(turn["images"] for e in episodes for turn in e["turns"][:1])
    # a task of 3 or more turns was pruned before its third: its turns open a segment there
    long = [e for e in episodes if len(e["turns"]) >= 3]
    assert long and all(e["turns"][2]["restart"] for e in long)
    segments = sum(1 + sum(t["restart"] for t in e["turns"][1:]) for e in episodes)
    assert segments > len(episodes)
    assert sum(m["trained_samples"] for m in metrics) > 0
