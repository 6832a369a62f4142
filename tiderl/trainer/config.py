"""Trainer section of a profile: backend, optimizer, memory and GRPO loss knobs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tiderl.core.config import require, require_choice, require_non_negative, require_positive
from tiderl.core.quote import short

BACKENDS = ("ddp", "fsdp2", "megatron")
LR_SCHEDULES = ("constant", "cosine")
OBJECTIVES = ("ppo", "decoupled")


@dataclass(frozen=True)
class TrainerConfig:
    backend: str = "ddp"
    tensor_parallel: int = 1  # megatron: TP ranks per model replica (consecutive ranks)
    lr: float = 1e-4
    lr_schedule: str = "constant"  # or cosine: to min_lr_ratio * lr at the job's last step
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps (both schedules)
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    clip_eps: float = 0.2  # PPO clip range on the behaviour-logprob ratio
    # "ppo": the clip on the behaviour ratio; "decoupled": AReaL's decoupled objective, behaviour
    # importance weights capped at is_weight_cap (trainer/loss.py), for stale tokens
    objective: str = "ppo"
    is_weight_cap: float = 5.0
    kl_beta: float = 0.01  # k3 KL to the ref model; 0 skips the ref
    adv_eps: float = 1e-6
    export_every: int = 0  # steps: an HF folder runs/<job>/hf/step-N; 0 = only at the end
    export_shard_mb: int = 2048  # safetensors shard size of those folders
    logits_chunk_tokens: int = 1024  # loss positions per lm_head chunk (recomputed in backward)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward
    train_vision: bool = False  # a model that reads images: its vision tower trains too

    def __post_init__(self) -> None:
        require_choice(self.backend, BACKENDS, "backend")
        require_choice(self.lr_schedule, LR_SCHEDULES, "lr_schedule")
        require_choice(self.objective, OBJECTIVES, "objective")
        require(self.is_weight_cap > 1, "is_weight_cap",
                f"expected a number > 1, got {short(self.is_weight_cap)}")
        require_positive(self.lr, "lr")
        for name in ("export_shard_mb", "logits_chunk_tokens", "tensor_parallel"):
            require_positive(getattr(self, name), name)
        for name in ("weight_decay", "grad_clip", "kl_beta", "adv_eps",
                     "export_every", "warmup_steps"):
            require_non_negative(getattr(self, name), name)
        require(self.tensor_parallel == 1 or self.backend == "megatron", "tensor_parallel",
                f"expected 1 with backend {self.backend} (tensor parallelism is the megatron "
                f"backend's), got {self.tensor_parallel}")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio",
                f"expected a number in [0, 1], got {short(self.min_lr_ratio)}")
        require(0 < self.clip_eps < 1, "clip_eps",
                f"expected a number in (0, 1), got {short(self.clip_eps)}")

    @property
    def loss_is_weight_cap(self) -> float | None:
        """The loss's behaviour-weight cap: None for PPO, else the decoupled objective's."""
        return self.is_weight_cap if self.objective == "decoupled" else None

    def lr_at(self, step: int, total_steps: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based: the policy version it starts
        from) of ``total_steps``. A function of the version alone, so a checkpoint's version, a
        joining actor's and a resumed job's give the same rate with no scheduler state."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        span = max(1, total_steps - self.warmup_steps - 1)
        progress = min(1.0, (step - self.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)
