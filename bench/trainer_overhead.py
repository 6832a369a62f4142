"""The trainer path's own cost: the same batches through a bare PyTorch GRPO loop and through
the code a trainer rank runs, side by side, step by step, in one process.

- ``bare``: what a single-process GRPO trainer does: per micro-batch, right-pad with
  ``pad_sequence``, ``model(ids)``, log-softmax and gather, the clipped token-level loss (plus the
  k3 KL to a frozen Ref model when ``kl_beta`` > 0), ``backward``; at the step's end clip and
  step AdamW (the loss is divided by N, the step's loss tokens, up front).
- ``job``: a trainer rank's path, in-process: each micro-batch is a ``MicroBatchData`` encoded and
  decoded with the bus's codec, turned into samples by the rank's own ``micro_batch_of`` and fed
  to a ``StreamedStep``; the rank's executor (``ColocatedExecutor`` of the colocated mode, DDP
  over a one-rank gloo world, as a job's single actor rank runs it) trains it, and the rank's
  ``step_done`` builds the ``StepDone`` it would send. Not measured: the socket hop (see
  ``bench/bus.py``) and the other processes of a job sharing the cores.

Both start from the same weights and see the same batches (guess-game shaped: 32 episodes of 8
turns, 2 generated tokens a turn; the micro-batches RA2P forms at ``tokens_per_rank``). The steps
alternate bare, job, bare, job, ... so machine load falls on both alike. Figures: seconds per
trained (loss) token, median over the measured steps, and job / bare (of the medians, and the
median of each step's pair); for ``kl_beta`` 0 (the Ref model is skipped) and for the profile's
``kl_beta`` (both paths run the Ref forward).

Run: ``.venv/bin/python bench/trainer_overhead.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence

sys.path.insert(0, str(Path(__file__).parent))
from machine import machine_info, write_result

from tiderl.core.grpo import group_advantages
from tiderl.core.ra2p import form_micro_batches
from tiderl.core.system import StepMode
from tiderl.models.random_init import init_model
from tiderl.models.vocab import VOCAB
from tiderl.runtime.bus import MicroBatchData, StepClosed, TrainStep
from tiderl.runtime.bus.messages import TrainSampleData, decode, encode
from tiderl.runtime.rank_wire import micro_batch_of, step_done
from tiderl.trainer.config import TrainerConfig
from tiderl.trainer.executors import ColocatedExecutor, StreamedStep
from tiderl.trainer.parallel import make_backend
from tiderl.trainer.sample import TrainSample
from tiderl.trainer.worker import ActorWorker, RefWorker

EPISODES, GROUP, TURNS, OUTPUT_TOKENS = 32, 8, 8, 2
PROMPT_TOKENS, OBSERVATION_TOKENS = (24, 36), (8, 14)
TOKENS_PER_RANK = 2048  # profiles/local.yaml's ra2p.tokens_per_rank
TARGET_RATIO = 1.3


def guess_samples(step: int, seed: int) -> list[TrainSample]:
    """One step's episodes: a prompt, then per turn 2 generated tokens (loss mask 1) and an
    observation; rewards drawn in [0, 1], advantages per group of 8."""
    rng = random.Random(seed * 1000 + step)
    rewards = [rng.random() for _ in range(EPISODES)]
    advantages = [a for g in range(0, EPISODES, GROUP)
                  for a in group_advantages(rewards[g:g + GROUP])]
    samples = []
    for i in range(EPISODES):
        mask = [0] * rng.randint(*PROMPT_TOKENS)
        for _ in range(TURNS):
            mask += [1] * OUTPUT_TOKENS + [0] * rng.randint(*OBSERVATION_TOKENS)
        ids = tuple(rng.randrange(len(VOCAB)) for _ in mask)
        logprobs = tuple(-7.3 + rng.uniform(-0.3, 0.3) if m else 0.0 for m in mask)
        samples.append(TrainSample(f"s{step}-{i}", ids, tuple(mask), logprobs, advantages[i]))
    return samples


def step_messages(step: int, samples: list[TrainSample]) -> list[list[bytes]]:
    """What the coordinator sends a trainer rank for one step, encoded as on the bus."""
    by_id = {s.seq_id: s for s in samples}
    mbs = form_micro_batches([s.as_sequence() for s in samples], 1, TOKENS_PER_RANK)
    frames = [encode(TrainStep(seq=0, step=step, step_mode=StepMode.COLOCATED, ref_ranks=[],
                               actor_ranks=[0], max_aggregate=8))]
    for mb in mbs:
        data = [TrainSampleData(seq_id=s.seq_id, input_ids=list(s.input_ids),
                                loss_mask=list(s.loss_mask), logprobs=list(s.logprobs),
                                advantage=s.advantage, version=s.version)
                for s in (by_id[r.seq_id] for r in mb.sequences)]
        frames.append(encode(MicroBatchData(seq=0, step=step, mb_id=mb.mb_id, samples=data)))
    frames.append(encode(StepClosed(seq=0, step=step)))
    return frames


# -- the bare loop -------------------------------------------------------------------------------

class BareLoop:
    def __init__(self, config: TrainerConfig):
        self.config = config
        self.model = init_model("tiny", seed=0).train()
        self.ref = init_model("tiny", seed=0) if config.kl_beta > 0 else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay)

    @staticmethod
    def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
        # the picked logit minus logsumexp (TRL's selective_log_softmax for float32): no second
        # [B, T, vocab] tensor, as a full log_softmax would make
        logits = model(ids)[:, :-1].float()
        return logits.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, -1)

    def step(self, micro_batches: list[list[TrainSample]]) -> int:
        cfg = self.config
        num_loss = sum(s.num_loss_tokens for mb in micro_batches for s in mb)
        for mb in micro_batches:
            ids = pad_sequence([torch.tensor(s.input_ids) for s in mb], batch_first=True)
            mask = pad_sequence([torch.tensor(s.loss_mask, dtype=torch.float32) for s in mb],
                                batch_first=True)[:, 1:]
            old = pad_sequence([torch.tensor(s.logprobs) for s in mb], batch_first=True)[:, 1:]
            adv = torch.tensor([s.advantage for s in mb])[:, None]
            logp = self._logprobs(self.model, ids)
            ratio = torch.exp((logp - old) * mask)
            per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip_eps,
                                                                1 + cfg.clip_eps) * adv)
            if self.ref is not None:
                with torch.no_grad():
                    ref = self._logprobs(self.ref, ids)
                log_ratio = (ref - logp) * mask
                per_token = per_token + cfg.kl_beta * (torch.exp(log_ratio) - log_ratio - 1)
            (per_token * mask).sum().div(num_loss).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return num_loss


# -- the trainer rank's path ---------------------------------------------------------------------

class JobPath:
    def __init__(self, config: TrainerConfig):
        self.config = config
        backend = make_backend("ddp", init_model("tiny", seed=0))
        self.actor = ActorWorker(backend, config)
        self.ref = None
        if config.kl_beta > 0:
            self.ref = RefWorker(make_backend("ddp", init_model("tiny", seed=0),
                                              trainable=False))

    def step(self, frames: list[list[bytes]]) -> int:
        cmd, *feed = (decode(f) for f in frames)
        stream = StreamedStep()
        for msg in feed:
            if isinstance(msg, MicroBatchData):
                stream.add(*micro_batch_of(msg))
            else:
                stream.close()
        executor = ColocatedExecutor.for_step_mode(cmd.step_mode, self.ref, self.actor,
                                              max_aggregate=cmd.max_aggregate,
                                              group=dist.group.WORLD)
        result = executor.run_step(stream, stream, time.time())
        done = step_done(0, cmd.step, result, stream)
        encode(done)
        return done.loss_tokens


def measure(config: TrainerConfig, steps: int, warmup: int) -> dict:
    bare, job = BareLoop(config), JobPath(config)
    times: dict[str, list[float]] = {"bare": [], "job": []}
    tokens = 0
    for step in range(warmup + steps):
        samples = guess_samples(step, seed=1)
        frames = step_messages(step, samples)
        by_id = {s.seq_id: s for s in samples}
        mbs = [[by_id[r.seq_id] for r in mb.sequences] for mb in
               form_micro_batches([s.as_sequence() for s in samples], 1, TOKENS_PER_RANK)]
        order = (("bare", bare.step, mbs), ("job", job.step, frames))
        for name, run, data in (order if step % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            n = run(data)
            if step >= warmup:
                times[name].append((time.perf_counter() - start) / n)
        tokens = n
    bare_us, job_us = (statistics.median(times[k]) * 1e6 for k in ("bare", "job"))
    paired = statistics.median(j / b for j, b in zip(times["job"], times["bare"], strict=True))
    return {"kl_beta": config.kl_beta, "loss_tokens_per_step": tokens,
            "bare_us_per_loss_token": round(bare_us, 2), "job_us_per_loss_token": round(job_us, 2),
            "job_over_bare": round(job_us / bare_us, 3),
            "job_over_bare_paired_median": round(paired, 3),
            "bare_step_s": round(bare_us * tokens / 1e6, 3),
            "job_step_s": round(job_us * tokens / 1e6, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "trainer_overhead.json"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="3 steps (a check it runs)")
    args = parser.parse_args()
    steps, warmup = (3, 1) if args.quick else (args.steps, 2)
    torch.set_num_threads(1)  # a rank's threads_per_rank; the bare loop gets the same core
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                                rank=0, world_size=1)
        try:
            runs = [measure(TrainerConfig(lr=1e-2, kl_beta=beta), steps, warmup)
                    for beta in (0.0, 0.01)]
        finally:
            dist.destroy_process_group()
    write_result(args.out, {
        "what": "seconds per trained (loss) token, bare single-process GRPO loop vs a trainer "
                "rank's path (bus decode, executor, DDP over a one-rank gloo world), in-process",
        "runs": runs, "target_job_over_bare": TARGET_RATIO, "steps": steps,
        "episodes_per_step": EPISODES, "tokens_per_rank": TOKENS_PER_RANK, "threads": 1,
        "machine": machine_info()})


if __name__ == "__main__":
    main()
