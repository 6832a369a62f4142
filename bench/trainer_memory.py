"""Peak memory of one trainer step at a long context: the padded full-logits path against the
packed, chunked one, with and without activation checkpointing.

A step is what an actor runs per micro-batch: log-probs of the batch, the GRPO loss (k3 KL to
given ref log-probs), backward. The batch: ``--seqs`` multi-turn sequences of lengths spread up
to ``--context`` tokens (right-padded to the longest for the padded path), loss mask on the
model's turns (about half the tokens). Paths:

- ``full``: ``token_logprobs`` on the right-padded batch (all of [B, T, vocab] in float32, kept
  for backward) -- the trainer before packing;
- ``chunked``: ``packed_token_logprobs``: no padding, the lm_head over loss positions only,
  ``--chunk`` rows at a time, each chunk's logits recomputed in backward;
- ``+ac``: each decoder layer recomputed in backward as well (``trainer.activation_checkpointing``).

Each path runs in a fresh process (peak RSS is per process): the figure is the peak resident
set of the step above the process's resident set just before it (model, optimizer-free, batch
built), and the step's seconds (median of 3 after the measured one). The models: ``small`` (its
1,568-word vocabulary) and ``small`` with a 32,768-token vocabulary (a BPE-sized head, where
the logits dominate). On a GPU, ``torch.cuda.max_memory_allocated`` would be the figure; this
runs on the CPU.

Run: ``.venv/bin/python bench/trainer_memory.py [--context 4096] [--seqs 4]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info, write_result

from tiderl.models.qwen2 import Qwen2ForCausalLM, packed_token_logprobs, token_logprobs
from tiderl.models.random_init import init_model
from tiderl.trainer.batch import pack
from tiderl.trainer.loss import grpo_loss_sum
from tiderl.trainer.sample import TrainSample

PATHS = ("full", "chunked", "full+ac", "chunked+ac")
MODELS = {"small": None, "small-v32k": 32768}
RESULT = Path(__file__).parent / "results" / "trainer_memory.json"


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def _model(name: str) -> Qwen2ForCausalLM:
    model = init_model("small", seed=0)
    vocab = MODELS[name]
    if vocab is None:
        return model
    config = dataclasses.replace(model.config, vocab_size=vocab)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def _batch(vocab: int, seqs: int, context: int):
    """Sequences of context, 3/4, 1/2, ... of ``context`` tokens; 8 turns each: an observation
    (mask 0) then a model turn (mask 1) of equal length."""
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(seqs):
        n = max(16, context * (seqs - i) // seqs)
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        turn = max(1, n // 16)
        mask = [int((t // turn) % 2 == 1) for t in range(n)]
        mask[0] = 0
        lp = [-2.0 * m for m in mask]
        samples.append(TrainSample(f"s{i}", tuple(ids), tuple(mask), tuple(lp), 0.5 - i % 2))
    return pack(samples)


def _step(model, batch, path: str, chunk: int) -> None:
    if path.startswith("full"):
        logprobs = token_logprobs(model, batch.input_ids, batch.loss_mask)
    else:
        logprobs = packed_token_logprobs(model, batch.input_ids, batch.loss_mask, chunk)
    ref = (logprobs.detach() - 0.05) * batch.loss_mask
    loss, _ = grpo_loss_sum(logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask,
                            ref, clip_eps=0.2, kl_beta=0.01)
    (loss / batch.num_loss_tokens).backward()
    model.zero_grad(set_to_none=True)


def one(model_name: str, path: str, seqs: int, context: int, chunk: int) -> dict:
    torch.set_num_threads(1)
    model = _model(model_name)
    for layer in model.model.layers:
        layer.checkpointed = path.endswith("+ac")
    batch = _batch(model.config.vocab_size, seqs, context)
    before = _rss_kib()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _step(model, batch, path, chunk)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(3):
        start = time.perf_counter()
        _step(model, batch, path, chunk)
        times.append(time.perf_counter() - start)
    return {"model": model_name, "path": path, "peak_step_mib": (peak - before) / 1024,
            "peak_rss_mib": peak / 1024, "peak_before_mib": peak_before / 1024,
            "step_s": statistics.median(times), "padded_tokens": int(batch.input_ids.numel()),
            "loss_tokens": batch.num_loss_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.seqs, args.context, args.chunk)))
        return
    rows = []
    for model_name in MODELS:
        for path in PATHS:
            out = subprocess.run([sys.executable, __file__, "--one", model_name, path,
                                  "--context", str(args.context), "--seqs", str(args.seqs),
                                  "--chunk", str(args.chunk)],
                                 capture_output=True, text=True, check=True)
            row = json.loads(out.stdout)
            rows.append(row)
            print(f"{model_name:11s} {path:11s} step peak {row['peak_step_mib']:8.1f} MiB  "
                  f"{row['step_s']:.2f} s", flush=True)
    by = {(r["model"], r["path"]): r for r in rows}
    ratios = {}
    for model_name in MODELS:
        full, chunked = by[(model_name, "full")], by[(model_name, "chunked")]
        ratios[model_name] = {
            "full / chunked": full["peak_step_mib"] / chunked["peak_step_mib"],
            "full+ac / chunked+ac": by[(model_name, "full+ac")]["peak_step_mib"]
            / by[(model_name, "chunked+ac")]["peak_step_mib"],
            "full / chunked+ac": full["peak_step_mib"]
            / by[(model_name, "chunked+ac")]["peak_step_mib"],
            "step_s full / chunked": full["step_s"] / chunked["step_s"],
        }
    result = {"machine": machine_info(), "context": args.context, "seqs": args.seqs,
              "chunk_tokens": args.chunk, "rows": rows, "ratios": ratios,
              "target": "peak step memory chunked vs full >= 2x lower"}
    write_result(RESULT, result)


if __name__ == "__main__":
    main()
