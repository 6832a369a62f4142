"""Trainer section of a profile: backend, optimizer and GRPO loss knobs."""

from __future__ import annotations

from dataclasses import dataclass

from tiderl.core.config import require, require_choice, require_non_negative, require_positive

BACKENDS = ("ddp", "fsdp2", "megatron")


@dataclass(frozen=True)
class TrainerConfig:
    backend: str = "ddp"
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_eps: float = 0.2  # PPO clip range on the behaviour-logprob ratio
    kl_beta: float = 0.01  # k3 KL to the ref model; 0 skips the ref
    adv_eps: float = 1e-6
    checkpoint_every: int = 0  # steps; 0 = only at the end

    def __post_init__(self) -> None:
        require_choice(self.backend, BACKENDS, "backend")
        require_positive(self.lr, "lr")
        for name in ("weight_decay", "grad_clip", "kl_beta", "adv_eps", "checkpoint_every"):
            require_non_negative(getattr(self, name), name)
        require(0 < self.clip_eps < 1, "clip_eps",
                f"expected a number in (0, 1), got {self.clip_eps!r}")
