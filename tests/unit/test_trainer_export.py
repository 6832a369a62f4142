"""Versioned HF folders for engine servers that load weights from disk."""

from __future__ import annotations

import torch

from tiderl.models.folder import load_tokenizer
from tiderl.models.loading import load_model
from tiderl.models.random_init import init_model
from tiderl.models.tokenizer import word_tokenizer
from tiderl.trainer.export import export_version, version_dir, versions


def test_a_version_is_a_loadable_hf_folder_and_only_the_newest_stay(tmp_path):
    model = init_model("tiny", seed=3)
    tokenizer = word_tokenizer()
    state = model.state_dict()
    folder = export_version(state, model.config, tokenizer, tmp_path, 1, keep=2)
    assert folder == tmp_path / "v00000001"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json"]
    loaded = load_model(folder)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert load_tokenizer(folder).get_vocab() == tokenizer.get_vocab()
    for version in (2, 3):
        export_version(state, model.config, tokenizer, tmp_path, version, keep=2)
    assert versions(tmp_path) == [2, 3]
    left = sorted(p.name for p in tmp_path.iterdir())  # no temporary folder left behind
    assert left == [".v00000002.lock", ".v00000003.lock", "v00000002", "v00000003"]


def test_a_version_another_rank_of_the_node_wrote_is_used_as_it_is(tmp_path):
    model = init_model("tiny", seed=0)
    theirs = version_dir(tmp_path, 4)
    theirs.mkdir(parents=True)
    (theirs / "written-by").write_text("rank 1")
    folder = export_version(model.state_dict(), model.config, word_tokenizer(), tmp_path, 4)
    assert folder == theirs and sorted(p.name for p in folder.iterdir()) == ["written-by"]


def test_shards_and_an_index_when_the_weights_exceed_the_shard_size(tmp_path):
    model = init_model("tiny", seed=0)
    folder = export_version(model.state_dict(), model.config, word_tokenizer(), tmp_path, 1,
                            max_shard_bytes=200_000)
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").exists()
    loaded = load_model(folder)
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in loaded.state_dict().items())
