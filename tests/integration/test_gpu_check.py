"""``bench/gpu/check.py`` as its dry check on the CPU: every stage it would run on a lent GPU
(the embedded engine against transformers, the trainer backends, a whole job with role moves,
the gpu-marked tests) runs here on the CPU and passes."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_runs_every_stage_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/gpu/check.py"), "--device", "cpu",
                           "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    stages = result["stages"]
    assert list(stages) == ["engine", "trainer", "job", "tests"]
    assert all(stage["ok"] for stage in stages.values()), stages
    engine = stages["engine"]
    assert engine["tokens_compared"] == 64 and engine["met"]  # fp32 on the CPU: equal
    assert engine["greedy_agreement"] == 1.0 and engine["decode_tok_s"] > 0
    trainer = stages["trainer"]
    assert set(trainer["backends"]) == {"ddp", "fsdp2"}
    assert trainer["max_loss_diff_vs_ddp"]["fsdp2"] < 1e-4
    assert trainer["skipped"] == {"megatron": "megatron-core's forward needs CUDA"}
    job = stages["job"]
    assert job["steps"] == 2 and job["role_changes"] >= 2  # the cold start's moves and back
    assert job["rank_devices"] == ["cpu"] * 4
    assert "skipped" in stages["tests"]["summary"]  # no CUDA device here
    assert result["ok"]
