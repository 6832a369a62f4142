"""A model folder as files: the weights get the mode every other file of it gets, and a random
checkpoint written over another model's folder leaves nothing of it that loading would read."""

from __future__ import annotations

import json
import stat

import pytest

from tiderl.models.folder import save_model
from tiderl.models.loading import load_config, load_model
from tiderl.models.random_init import init_model, write_random_checkpoint
from tiderl.models.vocab import EOS, VOCAB


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("shard", [None, 2_000_000])
def test_weights_have_the_mode_of_the_config(tmp_path, shard):
    save_model(init_model("tiny"), tmp_path, max_shard_bytes=shard)
    files = sorted(tmp_path.iterdir())
    assert len(files) == (2 if shard is None else 5)  # config (+ index) and the weights
    assert {f.name: mode(f) for f in files} == {f.name: mode(tmp_path / "config.json")
                                                for f in files}
    (tmp_path / "config.json").chmod(0o640)  # a folder already there keeps its files' mode
    save_model(init_model("tiny"), tmp_path, max_shard_bytes=shard)
    assert {mode(f) for f in tmp_path.glob("*.safetensors")} == {0o640}


def test_a_checkpoint_over_another_models_folder_leaves_none_of_its_files(tmp_path):
    write_random_checkpoint("tiny", tmp_path, seed=1, tokenizer="bpe")
    assert (tmp_path / "generation_config.json").exists()  # the BPE's eos set
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    (tmp_path / "notes.txt").write_text("mine")

    paths = write_random_checkpoint("tiny", tmp_path, seed=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.name for p in paths] + ["notes.txt"])
    assert load_config(tmp_path).eos_token_id == VOCAB.index(EOS)  # not the BPE's
    load_model(tmp_path)  # model.safetensors, not the stale index's shards
