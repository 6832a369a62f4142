"""Seeded synthetic training samples for benchmarks and tests: multi-turn shaped sequences
(context and model tokens alternate, as in an agent trajectory) with plausible behaviour logprobs
and group-standardised advantages."""

from __future__ import annotations

import math
import random

from tiderl.core.grpo import group_advantages
from tiderl.trainer.sample import TrainSample


def synthetic_samples(num: int, *, vocab_size: int, min_tokens: int, max_tokens: int,
                      group_size: int = 4, turns: int = 3, seed: int = 0) -> list[TrainSample]:
    """``num`` samples of ``min_tokens..max_tokens`` tokens, ``turns`` context/output pairs each,
    in GRPO groups of ``group_size`` (rewards drawn in [0, 1])."""
    if not 2 * turns <= min_tokens <= max_tokens:
        raise ValueError(f"need 2·turns <= min_tokens <= max_tokens, got {turns}, "
                         f"{min_tokens}, {max_tokens}")
    rng = random.Random(seed)
    rewards = [rng.random() for _ in range(num)]
    advantages: list[float] = []
    for start in range(0, num, group_size):
        advantages += group_advantages(rewards[start:start + group_size])
    uniform = -math.log(vocab_size)
    samples = []
    for i in range(num):
        length = rng.randint(min_tokens, max_tokens)
        cuts = sorted(rng.sample(range(1, length), 2 * turns - 1))
        bounds = [0, *cuts, length]
        mask: list[int] = []
        for part in range(2 * turns):  # even parts: context (mask 0), odd: model output (mask 1)
            mask += [part % 2] * (bounds[part + 1] - bounds[part])
        ids = tuple(rng.randrange(vocab_size) for _ in range(length))
        # near a uniform policy's logprob, as a freshly initialised model's would be
        logprobs = tuple(uniform + rng.uniform(-0.3, 0.3) if m else 0.0 for m in mask)
        samples.append(TrainSample(f"s{seed}-{i}", ids, tuple(mask), logprobs, advantages[i]))
    return samples
