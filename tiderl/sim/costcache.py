"""``CostModel`` with its size-only terms memoised: the simulator asks for them ~10^6 times.

``t_lin(n)`` and ``t_head(n)`` depend only on an integer, so they are cached per argument (every
other method calls them through ``self``, so prefill and training use the cache too). A decode
step is affine in the summed context (simcal §8.2: the KV read is Σℓ·b_kv/BW_kv), so it is
cached as base(B) + Σℓ·slope; Ref and Actor times are linear in their tokens at a given sequence
length, so they are cached per token by sequence length; a prefill's attention FLOPs take their
model-only factor (4·L_attn·H·h_d) from one product, and a prefill of one sequence (the engine's
usual pass) skips the parent's lists. The constructor checks affinity and linearity against the
parent class and falls back to the uncached formulas if they ever fail.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiderl.sim.hardware import CostModel

_PROBE_CONTEXT = 1_000_000


class CachedCostModel(CostModel):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._lin: dict[int, float] = {}
        self._head: dict[int, float] = {}
        self._decode_base: dict[int, float] = {}
        base = CostModel.decode_step_s(self, 1, 0)
        self._slope = (CostModel.decode_step_s(self, 1, _PROBE_CONTEXT) - base) / _PROBE_CONTEXT
        probe = CostModel.decode_step_s(self, 7, 3 * _PROBE_CONTEXT)
        guess = CostModel.decode_step_s(self, 7, 0) + 3 * _PROBE_CONTEXT * self._slope
        self._is_affine = abs(probe - guess) <= 1e-9 * probe
        self._per_token: dict[tuple[str, int], float] = {}
        # CostModel.attention_flops computes 4.0 * width * (...) left to right: the same product
        self._attention_scale = 4.0 * (self.model.num_attention_layers
                                       * self.model.attention_width)
        self._is_linear = False  # while probing: the parent's formulas
        self._is_linear = all(
            abs(getattr(CostModel, name)(self, 1000, 4096)
                - 1000 * getattr(CostModel, name)(self, 1, 4096))
            <= 1e-9 * getattr(CostModel, name)(self, 1000, 4096)
            for name in ("ref_fwd_s", "actor_fwd_s", "actor_bwd_s"))

    def t_lin(self, num_tokens: int) -> float:
        value = self._lin.get(num_tokens)
        if value is None:
            value = self._lin[num_tokens] = super().t_lin(num_tokens)
        return value

    def t_head(self, num_logits: int) -> float:
        value = self._head.get(num_logits)
        if value is None:
            value = self._head[num_logits] = super().t_head(num_logits)
        return value

    def prefill_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        if len(chunks) != 1 or chunks[0][0] <= 0:
            return super().prefill_s(chunks)
        new, cached = chunks[0]  # CostModel.prefill_s of one chunk, term for term
        return (self.gpu.step_overhead_s + self.t_lin(new) + self.t_head(1)
                + self.attention_flops(new, cached) / self.gpu.attn_flops)

    def attention_flops(self, new: int, cached: int) -> float:
        return self._attention_scale * (new * cached + new * new / 2.0)

    def decode_step_s(self, batch: int, sum_context: int) -> float:
        if not self._is_affine or batch <= 0:
            return super().decode_step_s(batch, sum_context)
        base = self._decode_base.get(batch)
        if base is None:
            base = self._decode_base[batch] = super().decode_step_s(batch, 0)
        return base + sum_context * self._slope

    def _linear(self, name: str, tokens: int, seq_len: int) -> float:
        key = (name, seq_len)
        per_token = self._per_token.get(key)
        if per_token is None:
            per_token = self._per_token[key] = getattr(CostModel, name)(self, 1, seq_len)
        return tokens * per_token

    def ref_fwd_s(self, tokens: int, seq_len: int) -> float:
        if not self._is_linear:
            return super().ref_fwd_s(tokens, seq_len)
        return self._linear("ref_fwd_s", tokens, seq_len)

    def actor_fwd_s(self, tokens: int, seq_len: int) -> float:
        if not self._is_linear:
            return super().actor_fwd_s(tokens, seq_len)
        return self._linear("actor_fwd_s", tokens, seq_len)

    def actor_bwd_s(self, tokens: int, seq_len: int) -> float:
        if not self._is_linear:
            return super().actor_bwd_s(tokens, seq_len)
        return self._linear("actor_bwd_s", tokens, seq_len)
