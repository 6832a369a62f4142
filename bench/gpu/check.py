"""The GPU check: everything TideRL runs on a CUDA device, in one prepared run of at most 8 minutes
on a machine with one NVIDIA GPU and no network. One JSON result.

Stages, each in its own process with its own time limit (a stage that fails or runs out of time
is recorded, and the next one runs):

1. ``engine``: the embedded engine on the device (torch's attention: no C++ kernels there)
   against transformers on the same HF folder (a random-init ``small`` Qwen2, bf16 on CUDA):
   8 prompts, 16 greedy tokens each; the engine's logprob of every token it chose against
   transformers' log-softmax of one forward over the whole sequence (max difference; target
   1e-3), the share of equal greedy tokens; then decode tokens per second at batch 32.
2. ``trainer``: ``bench/gpu/trainer_backends.py`` (DDP, FSDP2 bf16, megatron when megatron-core
   is installed; memory of packed chunked log-probs against full logits).
3. ``job``: a 3-step ``tiderl launch`` of ``profiles/local.yaml`` with ``runtime.device`` set:
   4 ranks sharing the one GPU (over gloo, each at a quarter of its memory), ERS's cold start
   moving the trainer ranks to rollout and back (role moves); its exit code, steps and role
   changes from the run folder.
4. ``tests``: ``pytest -m gpu`` (the tests that need a CUDA device).

On this machine, as a dry check (and a test, ``tests/integration/test_gpu_check.py``)::

    .venv/bin/python bench/gpu/check.py --device cpu --quick --out /tmp/check.json

On the GPU machine (Python 3.12, torch 2.11 for CUDA 13, transformers, safetensors, numpy,
typer, rich, httpx and prometheus-client are there; pyzmq, msgspec, fastapi, starlette, uvicorn,
pydantic, fabric, paramiko and megatron-core are not, and at most 64 MiB of files travel with a
command): ``make gpu-wheels`` downloads exactly the missing wheels for that interpreter into
``bench/gpu/wheels/`` (about 20 MiB; ignored by git, carried with the tree), and::

    python bench/gpu/check.py --device cuda --wheels bench/gpu/wheels --out $OUT/gpu_check.json

installs those of them that do not import, with ``pip install --no-index``, then runs the
stages; ``PYTHONPATH`` is the tree (no editable install there).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from machine import machine_info  # noqa: E402

# the imports the GPU machine lacks, by the wheel that brings each (make gpu-wheels: the same)
MISSING = {"zmq": "pyzmq", "msgspec": "msgspec", "fastapi": "fastapi", "starlette": "starlette",
           "uvicorn": "uvicorn", "pydantic": "pydantic", "pydantic_core": "pydantic-core",
           "annotated_types": "annotated-types", "typing_inspection": "typing-inspection",
           "fabric": "fabric", "paramiko": "paramiko", "invoke": "invoke", "bcrypt": "bcrypt",
           "nacl": "pynacl", "cryptography": "cryptography", "cffi": "cffi",
           "pycparser": "pycparser", "decorator": "decorator", "deprecated": "deprecated",
           "wrapt": "wrapt", "megatron.core": "megatron-core"}
LIMITS_S = {"engine": 120, "trainer": 200, "job": 180, "tests": 120}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def install_wheels(folder: str) -> dict:
    """Install, from ``folder`` only, the wheels of the modules that do not import here."""
    wanted = sorted({wheel for module, wheel in MISSING.items() if not _importable(module)})
    if not wanted:
        return {"installed": []}
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--find-links", folder, *wanted], capture_output=True, text=True)
    return {"installed": wanted, "returncode": proc.returncode,
            "tail": proc.stderr.strip().splitlines()[-3:]}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


# -- stage 1: the embedded engine against transformers --------------------------------------------

def engine_stage(device: str, quick: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from tiderl.engine.config import EngineConfig
    from tiderl.engine.llm_engine import LLMEngine
    from tiderl.engine.request import SamplingParams
    from tiderl.models.loading import load_model
    from tiderl.models.random_init import write_random_checkpoint

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    size, new_tokens = ("tiny", 8) if quick else ("small", 16)
    with tempfile.TemporaryDirectory() as folder:
        write_random_checkpoint(size, folder, seed=0)
        model = load_model(folder, dtype).to(device)
        engine = LLMEngine(model, EngineConfig(kv_cache_tokens=32 * 1024, max_num_seqs=64),
                           model.config.eos_token_id)
        generator = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        prompts = [torch.randint(4, vocab, (12 + 3 * i,), generator=generator).tolist()
                   for i in range(8)]
        greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                stop_token_ids=tuple(range(4)))
        requests = [engine.add_request(f"p{i}", p, greedy) for i, p in enumerate(prompts)]
        while not all(r.is_finished for r in requests):
            engine.step()
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                  local_files_only=True).to(device)
        diffs, same, total = [], 0, 0
        with torch.no_grad():
            for r in requests:
                ids = torch.tensor([r.prompt_token_ids + r.output_token_ids], device=device)
                logp = hf(input_ids=ids).logits[0].float().log_softmax(-1)
                start = len(r.prompt_token_ids) - 1
                for k, (token, got) in enumerate(zip(r.output_token_ids, r.output_logprobs,
                                                     strict=True)):
                    row = logp[start + k]
                    diffs.append(abs(float(row[token]) - got))
                    same += int(int(row.argmax()) == token)
                    total += 1
        batch, steps = (8, 8) if quick else (32, 64)
        decode = SamplingParams(max_tokens=steps, temperature=1.0, seed=0)
        runs = [engine.add_request(f"d{i}", prompts[i % 8], decode) for i in range(batch)]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        begin, before = time.perf_counter(), engine.decode_tokens
        while not all(r.is_finished for r in runs):
            engine.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - begin
    worst = max(diffs)
    return {"model": size, "dtype": str(dtype).removeprefix("torch."),
            "tokens_compared": total, "max_logprob_diff": worst, "target": 1e-3,
            "met": worst <= 1e-3, "greedy_agreement": same / total,
            "decode_batch": batch, "decode_tok_s": (engine.decode_tokens - before) / seconds}


# -- stage 3: a whole job on the device -----------------------------------------------------------

def job_stage(device: str, quick: bool, run_root: Path) -> dict:
    steps = 2 if quick else 3
    argv = [sys.executable, "-m", "tiderl.cli.main", "launch", "--json", "--run-root",
            str(run_root), "--set", f"job.steps={steps}", "--set", f"runtime.device={device}",
            "--set", "runtime.cpu_affinity=spread", "--set", "report.plots=false",
            "--set", "env.step_latency.kind=none"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=_env(),
                          timeout=LIMITS_S["job"])
    out = {"returncode": proc.returncode, "stderr_tail": proc.stderr.strip().splitlines()[-3:]}
    if proc.returncode != 0:
        return out
    run_dir = Path(json.loads(proc.stdout)["run_dir"])
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((run_dir / "job.json").read_text())
    ranks = [p for p in plan["processes"] if p["kind"] == "rank"]
    return {**out, "steps": len(records), "goodput_tok_s": records[-1]["goodput_tok_s"],
            "role_changes": sum(e["kind"] == "role_change" for e in events),
            "rank_devices": [p["argv"][p["argv"].index("--device") + 1] for p in ranks]}


# -- the run --------------------------------------------------------------------------------------

def run_stage(name: str, args: argparse.Namespace) -> dict:
    """One stage in a process of its own (``--stage``), within its time limit."""
    argv = [sys.executable, __file__, "--stage", name, "--device", args.device]
    if args.quick:
        argv.append("--quick")
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=_env(),
                              timeout=LIMITS_S[name])
    except subprocess.TimeoutExpired:
        return {"ok": False, "seconds": round(time.monotonic() - start, 1),
                "error": f"ran past {LIMITS_S[name]} s"}
    seconds = round(time.monotonic() - start, 1)
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (ValueError, IndexError):
        tail = proc.stderr.strip().splitlines()[-5:]
        return {"ok": False, "seconds": seconds, "returncode": proc.returncode, "error": tail}
    return {"ok": proc.returncode == 0, "seconds": seconds, **result}


def stage_main(name: str, args: argparse.Namespace) -> None:
    if name == "engine":
        result = engine_stage(args.device, args.quick)
    elif name == "trainer":
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "trainer.json"
            cmd = [sys.executable, str(ROOT / "bench/gpu/trainer_backends.py"), "--device",
                   args.device, "--out", str(out),
                   *(["--context", "512", "--size", "tiny"] if args.quick else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
            result = json.loads(out.read_text()) if out.exists() else {
                "error": proc.stderr.strip().splitlines()[-3:]}
            result.pop("machine", None)
    elif name == "job":
        with tempfile.TemporaryDirectory() as tmp:
            result = job_stage(args.device, args.quick, Path(tmp))
        if result.get("returncode"):
            print(json.dumps(result))
            raise SystemExit(1)
    else:
        # the files that hold gpu-marked tests: collecting the whole suite takes longer than
        # they run without a device
        where = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                       if "mark.gpu" in p.read_text())
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                               "no:cacheprovider", *where], cwd=ROOT, capture_output=True,
                              text=True, env=_env())
        lines = proc.stdout.strip().splitlines()
        result = {"returncode": proc.returncode, "summary": lines[-1] if lines else ""}
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", default=str(ROOT / "bench/results/gpu_check.json"))
    parser.add_argument("--wheels", default="", help="a folder of wheels to install first")
    parser.add_argument("--quick", action="store_true",
                        help="smaller model, fewer tokens and steps (the CPU dry check)")
    parser.add_argument("--stage", default="", help=argparse.SUPPRESS)
    parser.add_argument("--stages", default=",".join(LIMITS_S))
    args = parser.parse_args()
    if args.stage:
        stage_main(args.stage, args)
        return
    result: dict = {"machine": machine_info(), "device": args.device, "quick": args.quick}
    if args.wheels:
        result["wheels"] = install_wheels(args.wheels)
    start = time.monotonic()
    result["stages"] = {}
    for name in args.stages.split(","):
        result["stages"][name] = run_stage(name, args)
        print(name, json.dumps(result["stages"][name]), flush=True)
    result["seconds"] = round(time.monotonic() - start, 1)
    result["ok"] = all(s["ok"] for s in result["stages"].values())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
