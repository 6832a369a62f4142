"""The trainer backends on a CUDA device, in one short run for a lent GPU machine.

Per backend (ddp, fsdp2 with bf16 parameters and fp32 reduction, megatron with TP = PP = 1), one
rank on the device trains the same three GRPO steps on the same synthetic batches from the same
weights: losses, grad norms, step seconds and the device's peak memory
(``torch.cuda.max_memory_allocated``). Then the memory of one step at a long context, padded
full logits against packed chunked log-probs (the figure ``bench/trainer_memory.py`` measures as
RSS on the CPU). Then the ``gpu``-marked tests of the megatron backend. One JSON result.

The machine has one GPU, so each backend runs a world of one: FSDP2 shards over one rank (its
mixed-precision casts and hooks run; the reduce-scatter is trivial) and megatron's torch DDP has
nothing to reduce. A multi-GPU machine would run ``tests/e2e/test_trainer_backends.py`` with
``runtime.device=cuda`` for the job path.

Prepared and checked on the CPU with ``--device cpu`` (megatron is then skipped: its forward
needs CUDA). On the device::

    python bench/gpu/trainer_backends.py --device cuda --out $OUT/gpu_trainer_backends.json

megatron-core is needed for the megatron rows: ``pip install megatron-core==0.16.1`` (or a wheel
carried with the tree, ``--wheel path``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from machine import machine_info  # noqa: E402

from tiderl.models.qwen2 import packed_token_logprobs, token_logprobs  # noqa: E402
from tiderl.models.random_init import init_model  # noqa: E402
from tiderl.trainer.batch import pack  # noqa: E402
from tiderl.trainer.config import TrainerConfig  # noqa: E402
from tiderl.trainer.loss import grpo_loss_sum  # noqa: E402
from tiderl.trainer.spawn import RankContext, run_ranks  # noqa: E402
from tiderl.trainer.synthetic import synthetic_samples  # noqa: E402
from tiderl.trainer.worker import ActorWorker  # noqa: E402

BACKENDS = ("ddp", "fsdp2", "megatron")
CONFIG = TrainerConfig(lr=1e-3, kl_beta=0.0)


def _peak(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def _steps(ctx: RankContext, arg: tuple[str, str]) -> dict:
    from tiderl.trainer.parallel import make_backend

    backend, size = arg
    model = init_model(size, seed=0).to(ctx.device)
    actor = ActorWorker(make_backend(backend, model), CONFIG)
    out = {"losses": [], "grad_norms": [], "step_s": []}
    for step in range(3):
        samples = synthetic_samples(16, vocab_size=model.config.vocab_size, min_tokens=64,
                                    max_tokens=512, seed=step)
        batch = pack(samples, ctx.device)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
            torch.cuda.reset_peak_memory_stats(ctx.device)
        start = time.perf_counter()
        stats = actor.train(batch, None, sync=True)
        result = actor.optimizer_step(batch.num_loss_tokens)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        out["step_s"].append(time.perf_counter() - start)
        out["losses"].append(stats.loss_sum / stats.loss_tokens)
        out["grad_norms"].append(result.grad_norm)
    out["peak_mib"] = _peak(ctx.device)
    return out


def _memory(ctx: RankContext, arg: tuple[str, int, str]) -> dict:
    path, context, size = arg
    model = init_model(size, seed=0).to(ctx.device)
    samples = synthetic_samples(4, vocab_size=model.config.vocab_size, min_tokens=context // 4,
                                max_tokens=context, seed=0)
    batch = pack(samples, ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device) / 2**20 if ctx.device.type == "cuda" else 0.0
    start = time.perf_counter()
    if path == "full":
        logprobs = token_logprobs(model, batch.input_ids, batch.loss_mask)
    else:
        logprobs = packed_token_logprobs(model, batch.input_ids, batch.loss_mask)
    loss, _ = grpo_loss_sum(logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask,
                            None, clip_eps=0.2, kl_beta=0.0)
    loss.backward()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    peak = _peak(ctx.device)
    return {"path": path, "context": context, "step_s": time.perf_counter() - start,
            "peak_above_weights_mib": None if peak is None else peak - base}


def _megatron_tests() -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p",
                           "no:cacheprovider", "tests/unit/test_trainer_megatron.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    lines = proc.stdout.strip().splitlines()
    return {"returncode": proc.returncode, "summary": lines[-1] if lines else "",
            "tail": "\n".join(lines[-30:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=str(ROOT / "bench/results/gpu_trainer_backends.json"))
    parser.add_argument("--wheel", default="", help="a megatron-core wheel to install first")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--size", default="small", help="the random-init model (tiny: a quick "
                                                        "check of the path)")
    args = parser.parse_args()
    if args.wheel:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", args.wheel],
                       check=True)
    result: dict = {"machine": machine_info(), "device": args.device, "backends": {},
                    "memory": [], "skipped": {}}
    for backend in BACKENDS:
        if backend == "megatron":
            try:
                import megatron.core  # noqa: F401
            except ImportError:
                result["skipped"][backend] = "megatron-core is not installed"
                continue
            if args.device != "cuda":
                result["skipped"][backend] = "megatron-core's forward needs CUDA"
                continue
        (row,) = run_ranks(_steps, 1, (backend, args.size), device=args.device, timeout_s=300)
        result["backends"][backend] = row
        print(backend, json.dumps(row), flush=True)
    ddp = result["backends"]["ddp"]["losses"]
    result["max_loss_diff_vs_ddp"] = {
        name: max(abs(a - b) for a, b in zip(row["losses"], ddp, strict=True))
        for name, row in result["backends"].items()}
    for path in ("full", "chunked"):
        (row,) = run_ranks(_memory, 1, (path, args.context, args.size), device=args.device,
                           timeout_s=300)
        result["memory"].append(row)
        print(json.dumps(row), flush=True)
    if args.device == "cuda":
        result["megatron_gpu_tests"] = _megatron_tests()
        print(result["megatron_gpu_tests"]["summary"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
