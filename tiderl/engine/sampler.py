"""Batched sampling of next tokens: temperature, top-p (nucleus), per-request seeds.

One call samples every row of ``logits`` [num_seqs, vocab] at once. Each row ``r`` samples from

    p_r = renormalise(top_p_r(softmax(logits_r / temperature_r)))

and the returned logprob is ``log p_r(token)``: the log-probability of the sampled token under
that exact distribution (temperature-scaled, truncated to the nucleus, renormalised), i.e. the
behaviour policy's logprob. ``temperature == 0`` is greedy (argmax of the raw logits); its
distribution is degenerate, so its logprob is the model's own, ``log_softmax(logits)`` at
temperature 1 without top-p (as vLLM reports for greedy requests).

Sampling is the exponential race ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per token, an exact
draw from ``p``; ``E`` is drawn as ``-log U`` with ``U`` uniform (``Tensor.exponential_`` costs
about 5x ``rand`` + ``log`` on the CPU: 0.9 ms against 0.19 ms for 32 x 1568). A request with a
seed draws its noise from a ``torch.Generator`` seeded by ``(seed, num_output_tokens)``, so its
n-th token depends only on its seed and its context:
reproducible across batches, and across a preemption and recompute. Unseeded rows share the
sampler's own generator.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tiderl.engine.request import SamplingParams

_SEED_STRIDE = 1_000_003  # seed * stride + n: distinct streams per (seed, output index)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, V] -> (token ids int64 [N], logprobs float32 [N]), both on the CPU."""
        logits = logits.float()
        if all(p.temperature == 0 for p in params):
            tokens = logits.argmax(dim=-1, keepdim=True)
            picked = torch.log_softmax(logits, dim=-1).gather(-1, tokens)
            return tokens.squeeze(-1).cpu(), picked.squeeze(-1).cpu()
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        greedy = temps == 0
        scale = torch.where(greedy, torch.ones_like(temps), temps).to(logits.device)
        logprobs = torch.log_softmax(logits / scale.unsqueeze(-1), dim=-1)
        top_p = torch.tensor([1.0 if p.temperature == 0 else p.top_p for p in params])
        if bool((top_p < 1).any()):
            logprobs = _top_p(logprobs, top_p.to(logits.device))
        noise = self._noise(logprobs.shape, params, num_output_tokens).to(logits.device)
        sampled = (logprobs - noise.log()).argmax(dim=-1)
        tokens = torch.where(greedy.to(logits.device), logits.argmax(dim=-1), sampled)
        picked = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return tokens.cpu(), picked.cpu()

    def _noise(self, shape: torch.Size, params: Sequence[SamplingParams],
               num_output_tokens: Sequence[int]) -> torch.Tensor:
        """Exp(1) noise [N, V]; seeded rows from their own generator."""
        noise = torch.rand(shape, generator=self.generator)
        for row, (p, n) in enumerate(zip(params, num_output_tokens, strict=True)):
            if p.seed is not None and p.temperature > 0:
                gen = torch.Generator().manual_seed((p.seed * _SEED_STRIDE + n) % 2**63)
                noise[row] = torch.rand(shape[-1], generator=gen)
        return noise.log_().neg_()


def _top_p(logprobs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches top_p (at least
    one), renormalised; the rest get -inf."""
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    probs = sorted_lp.exp()
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p.unsqueeze(-1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    kept = logprobs.masked_fill(drop, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)
