"""`tiderl model init` as a user runs it: a real process writes a loadable, seeded checkpoint."""

import json
import subprocess
import sys

from tests.integration.test_cli import assert_one_line_error, tiderl


def test_model_init_writes_three_files_and_is_seeded(tmp_path):
    runs = []
    for name in ("a", "b"):
        proc = tiderl("model", "init", "--size", "tiny", "--out", str(tmp_path / name),
                      "--seed", "3", "--json")
        assert proc.returncode == 0, proc.stderr
        runs.append(json.loads(proc.stdout))
    names = ["config.json", "model.safetensors", "tokenizer.json"]
    assert list(runs[0]["files"]) == names and runs[0]["size"] == "tiny"
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["hidden_size"] == 128


def test_model_init_human_output(tmp_path):
    proc = tiderl("model", "init", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "model.safetensors" in proc.stdout


def test_model_init_bad_size_is_one_line_exit_2(tmp_path):
    line = assert_one_line_error(tiderl("model", "init", "--size", "huge", "--out",
                                        str(tmp_path)), 2)
    assert "huge" in line and "tiny" in line
    assert not any(tmp_path.iterdir())


def test_loading_a_folder_imports_neither_dynamo_nor_sympy(tmp_path):
    """What `tiderl engine serve --model` does before /health says 200: the model is built on
    the meta device and filled from the folder. Meta-device init and empty_like run Python
    references that import torch._dynamo and sympy (2.2 s together, more than the rest of the
    start-up); the loader avoids both."""
    assert tiderl("model", "init", "--out", str(tmp_path)).returncode == 0
    code = ("import sys; from tiderl.models.config import ModelConfig; "
            "from tiderl.models.loading import model_from_config; "
            f"model, _ = model_from_config(ModelConfig(path={str(tmp_path)!r}), 'cpu'); "
            "print(sorted({'torch._dynamo', 'sympy'} & set(sys.modules)), "
            "model.model.embed_tokens.weight.abs().sum().item() > 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "True"]  # and the weights were read
