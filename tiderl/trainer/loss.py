"""The GRPO loss: token-level PPO clip on behaviour logprobs plus a k3 KL to the ref model.

Per loss token t of a sequence with advantage A (mask 1 only on model-generated tokens):

    r_t   = exp(logp_t - old_t)                       old_t: the rollout engine's logprob
    pg_t  = -min(r_t · A, clip(r_t, 1 - eps, 1 + eps) · A)
    kl_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1     (k3; >= 0, unbiased for KL(π||ref))
    loss  = Σ_t mask_t · (pg_t + beta · kl_t)  /  N

N is the number of loss tokens of the whole global batch, across micro-batches and ranks. When
streaming, N is known only at the end of the step, so ``grpo_loss_sum`` returns the unnormalised
sum and the actor scales the accumulated gradients by 1/N once, before the optimizer step.

``trainer.objective: decoupled`` is AReaL's decoupled PPO objective, for tokens sampled by an
older policy (a straggler carried past the staleness bound, ``job.carry_versions``). It splits
the ratio at a proximal policy: w_t = π_prox / π_behav (not differentiated) weighs the clipped
term of r_t = π_θ / π_prox. A step makes one optimizer update, so the proximal policy is the one
every micro-batch's forward runs (logp_t itself, detached: no extra pass), r_t = 1 with the
gradient of logp_t, and the clip never binds:

    w_t   = exp(sg(logp_t) - old_t);  tokens with w_t > is_weight_cap contribute nothing
    pg_t  = -w_t · min(r_t · A, clip(r_t, 1 - eps, 1 + eps) · A),   r_t = exp(logp_t - sg(logp_t))

Under plain PPO a stale token whose ratio left [1 - eps, 1 + eps] in its advantage's direction
gives no gradient; here it gives one, weighed by how far its behaviour policy was, and capped.
``clipped_tokens`` then counts the tokens above the cap.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class LossStats:
    """Sums over loss tokens (divide by ``loss_tokens`` for means); they add across micro-batches
    and ranks."""

    loss_sum: float = 0.0
    pg_sum: float = 0.0
    kl_sum: float = 0.0
    ratio_sum: float = 0.0
    clipped_tokens: float = 0.0
    loss_tokens: float = 0.0

    def __iadd__(self, other: LossStats) -> LossStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> LossStats:
        return cls(*(float(v) for v in values.tolist()))

    def means(self) -> dict[str, float]:
        n = max(self.loss_tokens, 1.0)
        return {"loss": self.loss_sum / n, "pg_loss": self.pg_sum / n, "kl": self.kl_sum / n,
                "ratio": self.ratio_sum / n, "clip_frac": self.clipped_tokens / n}


def grpo_loss_sum(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  loss_mask: torch.Tensor, ref_logprobs: torch.Tensor | None, *,
                  clip_eps: float, kl_beta: float,
                  is_weight_cap: float | None = None) -> tuple[torch.Tensor, LossStats]:
    """The unnormalised GRPO loss of a batch ``[B, T]`` (advantages ``[B]``) and its stats.

    ``ref_logprobs`` may be None only when ``kl_beta`` is 0 (then the ref model is skipped).
    ``is_weight_cap``: the decoupled objective with that cap (None: PPO on the behaviour ratio).
    """
    if kl_beta > 0 and ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref logprobs")
    mask = loss_mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    if is_weight_cap is None:
        ratio = torch.exp((logprobs - old_logprobs) * mask)  # 1 on masked positions
        clipped_ratio = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
        pg = -torch.minimum(ratio * adv, clipped_ratio * adv)
        with torch.no_grad():
            clipped = ((ratio * adv) > (clipped_ratio * adv)) & (mask > 0)
            behaviour = ratio
    else:
        proximal = logprobs.detach()
        behaviour = torch.exp((proximal - old_logprobs) * mask)  # w_t, no gradient
        clipped = (behaviour > is_weight_cap) & (mask > 0)
        ratio = torch.exp((logprobs - proximal) * mask)
        clipped_ratio = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
        pg = -torch.minimum(ratio * adv, clipped_ratio * adv) * behaviour * ~clipped
    per_token = pg
    kl = torch.zeros_like(logprobs)
    if kl_beta > 0:
        log_ref_ratio = (ref_logprobs.to(logprobs.dtype) - logprobs) * mask
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0
        per_token = pg + kl_beta * kl
    loss_sum = (per_token * mask).sum()
    with torch.no_grad():
        stats = LossStats(loss_sum=float(loss_sum), pg_sum=float((pg * mask).sum()),
                          kl_sum=float((kl * mask).sum()),
                          ratio_sum=float((behaviour * mask).sum()),
                          clipped_tokens=float(clipped.sum()), loss_tokens=float(mask.sum()))
    return loss_sum, stats
