"""Analytic cost model of one H100 for the simulator: rollout, training, swaps, weight sync.

Every constant names the section of ``docs/calibration.md`` it comes from; the table of
constants, sources and the figures this model reproduces is ``docs/simulator-hardware.md``.
Pure arithmetic: no torch, no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from tiderl.core.config import require, require_fraction, require_non_negative, require_positive
from tiderl.core.quote import short
from tiderl.core.types import Role

GIB = 1024**3
BF16_BYTES = 2


# Bytes per parameter a colocated trainer holds: bf16 weights 2 + bf16 grads 2 + fp32 master,
# Adam m and v 12 (calibration §5) + the colocated Ref's bf16 weights 2.
TRAIN_STATE_BYTES_PER_PARAM = 18


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder's shape (HF ``config.json`` names in comments); derived sizes of calibration §8.

    Dense models use only the first nine fields. Hybrid models (Qwen3.5: Gated DeltaNet linear
    attention on most layers) set ``full_attention_interval`` and the ``linear_*`` fields.
    """

    name: str
    num_layers: int  # num_hidden_layers
    hidden: int  # hidden_size
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads
    head_dim: int  # head_dim (hidden / heads when absent)
    ffn: int  # intermediate_size
    vocab: int  # vocab_size
    tie_embeddings: bool = False  # tie_word_embeddings
    qkv_bias: bool = False  # Qwen2.5 has QKV bias; Qwen3 and later do not
    full_attention_interval: int = 1  # every k-th layer is full attention (holds KV); 1 = dense
    attn_output_gate: bool = False  # Qwen3.5 gated attention: q_proj is twice as wide
    linear_key_heads: int = 0  # linear_num_key_heads (Gated DeltaNet layers)
    linear_value_heads: int = 0  # linear_num_value_heads
    linear_head_dim: int = 128  # linear_key_head_dim = linear_value_head_dim
    linear_conv_kernel: int = 4  # linear_conv_kernel_dim
    vision_params: int = 0  # vision tower: weight bytes only, no per-token LM cost
    activation_peak_gib: float | None = None  # calibration §8.4 A_peak; None = rule in kv_capacity

    @property
    def num_attention_layers(self) -> int:
        return self.num_layers // self.full_attention_interval

    @property
    def num_linear_layers(self) -> int:
        return self.num_layers - self.num_attention_layers

    @property
    def attention_width(self) -> int:
        """H·h_d: the width of the attention score and value products."""
        return self.num_heads * self.head_dim

    @property
    def attention_mixer_params(self) -> int:
        """Q, K, V and O projections of one full-attention layer (calibration §8)."""
        q_out = self.attention_width * (2 if self.attn_output_gate else 1)
        kv_out = 2 * self.num_kv_heads * self.head_dim
        return self.hidden * (q_out + kv_out) + self.attention_width * self.hidden

    @property
    def linear_mixer_params(self) -> int:
        """Matmul params of one Gated DeltaNet mixer: in_proj_qkv, z, a, b and out_proj."""
        key_dim = self.linear_key_heads * self.linear_head_dim
        value_dim = self.linear_value_heads * self.linear_head_dim
        in_proj = self.hidden * (2 * key_dim + 2 * value_dim + 2 * self.linear_value_heads)
        return in_proj + value_dim * self.hidden

    @property
    def mlp_params(self) -> int:
        return 3 * self.hidden * self.ffn  # SwiGLU gate, up, down

    @property
    def params_layers(self) -> int:
        """Matmul params of all transformer layers."""
        attention = self.num_attention_layers * self.attention_mixer_params
        linear = self.num_linear_layers * self.linear_mixer_params
        return self.num_layers * self.mlp_params + attention + linear

    @property
    def params_layer(self) -> float:
        """P_layer (calibration §8), the mean over layers for a hybrid model."""
        return self.params_layers / self.num_layers

    @property
    def params_embedding(self) -> int:
        return self.vocab * self.hidden * (1 if self.tie_embeddings else 2)

    @property
    def params_small(self) -> int:
        """Norms and QKV biases (vectors): 0.004% of the weights, kept so totals match cards."""
        norms = (2 * self.num_layers + 1) * self.hidden
        kv_width = self.num_kv_heads * self.head_dim
        bias = self.num_attention_layers * (self.attention_width + 2 * kv_width)
        return norms + (bias if self.qkv_bias else 0)

    @property
    def params_total(self) -> int:
        return self.params_layers + self.params_embedding + self.params_small + self.vision_params

    @property
    def params_matmul(self) -> int:
        """N_mm = L·P_layer + V·d (calibration §8): the params every token multiplies through."""
        return self.params_layers + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        """W, bf16 (calibration §1)."""
        return BF16_BYTES * self.params_total

    @property
    def kv_bytes_per_token(self) -> int:
        """b_kv = 2 (K, V) · L_attn · H_kv · h_d · 2 B (calibration §1)."""
        return 2 * self.num_attention_layers * self.num_kv_heads * self.head_dim * BF16_BYTES

    @property
    def state_bytes_per_seq(self) -> int:
        """Recurrent state of the linear-attention layers per sequence (0 for dense models).

        fp32 delta-rule state (``mamba_ssm_dtype: float32``) plus the bf16 conv window.
        """
        value_dim = self.linear_value_heads * self.linear_head_dim
        recurrent = self.linear_value_heads * self.linear_head_dim**2 * 4
        conv_channels = 2 * self.linear_key_heads * self.linear_head_dim + value_dim
        conv = (self.linear_conv_kernel - 1) * conv_channels * BF16_BYTES
        return self.num_linear_layers * (recurrent + conv)


def _vision_tower_params(depth: int, width: int, ffn: int, out: int, mergers: int) -> int:
    """A ViT tower (QKV+O, two-matrix MLP per block) plus 2x2 patch mergers (4·width -> out)."""
    blocks = depth * (4 * width * width + 2 * width * ffn)
    merger = 4 * width * 4 * width + 4 * width * out
    return blocks + mergers * merger


MODELS: dict[str, ModelSpec] = {
    # calibration §1 (HF config.json, conf H).
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064,
                            qkv_bias=True, activation_peak_gib=5.0),  # A_peak calibration §8.4
    "qwen2.5-14b": ModelSpec("qwen2.5-14b", 48, 5120, 40, 8, 128, 13824, 152064,
                             qkv_bias=True, activation_peak_gib=5.5),  # A_peak calibration §8.4
    # Qwen/Qwen3-VL-4B-Instruct config.json text_config (copies read through code search; H).
    # Vision: depth 24, width 1024, ffn 4096, out 2560, 3 deepstack mergers + the main one (M).
    "qwen3-vl-4b": ModelSpec("qwen3-vl-4b", 36, 2560, 32, 8, 128, 9728, 151936,
                             tie_embeddings=True,
                             vision_params=_vision_tower_params(24, 1024, 4096, 2560, 4)),
    # Qwen/Qwen3.5-9B config.json (copies read through code search; H for the shape): 3 Gated
    # DeltaNet layers then 1 gated full-attention layer, x8. tie_word_embeddings false is read
    # from a GGUF that ships a separate output tensor (M). The vision tower's config was not
    # found: assumed the Qwen3.5 tower seen for smaller models (depth 27, width 1152, ffn 4304;
    # L). The MTP draft layer is not counted (RL rollout does not load it).
    "qwen3.5-9b": ModelSpec("qwen3.5-9b", 32, 4096, 16, 4, 256, 12288, 248320,
                            full_attention_interval=4, attn_output_gate=True,
                            linear_key_heads=16, linear_value_heads=32,
                            vision_params=_vision_tower_params(27, 1152, 4304, 4096, 1)),
}


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """One GPU and its links; defaults: an H100 80GB SXM in an HGX node (calibration §2, §8)."""

    name: str = "h100-sxm"
    memory_bytes: float = 85_045_477_376  # §2: 79.18 GiB usable (llm-d empirical results)
    hbm_bw: float = 3.35e12  # §2 datasheet; the roofline BW of the §3.2 fit
    gemm_flops: float = 640e12  # §3.2 fit F (GEMM plateau 630-660 TFLOP/s)
    layer_overhead_s: float = 55e-6  # §3.2 fit c, per layer per step
    kv_bw: float = 2.3e12  # §8.2 BW_kv (effective decode read bandwidth, §2/§3.3)
    attn_flops: float = 400e12  # §8.3 F_attn (realistic causal FA prefill)
    peak_flops: float = 989e12  # §2 dense BF16 peak
    step_overhead_s: float = 0.8e-3  # §8.2 T0 (vLLM V1 / SGLang with CUDA graphs: 0.5-1 ms)
    pcie_bw: float = 50e9  # §2/§8.7 pinned DMA, one direction
    pcie_duplex_bw: float = 83.4e9  # §2 both directions at once, total (vLLM offloading blog)
    nvlink_bw: float = 340e9  # §2/§8.8 NCCL P2P at 64 MB
    ib_bw: float = 35e9  # §2/§8.8 one inter-node stream (32-36 measured, 35-45 quoted)
    gpus_per_node: int = 8
    non_torch_bytes: float = 0.13 * GIB  # §3.1/§8.4 non-torch memory at vLLM start


GPUS: dict[str, GPUSpec] = {"h100-sxm": GPUSpec()}


@dataclass(frozen=True, slots=True)
class CostKnobs:
    """The framework-dependent knobs of calibration §8 (sweep them; see the doc for ranges)."""

    mfu_train: float = 0.38  # §8.5 (0.33-0.45)
    mfu_fwd: float = 0.38  # §8.6 (0.3-0.5)
    recompute: float = 0.0  # §8.5 r: 0 selective, 1 full activation recompute
    kv_mem_util: float = 0.9  # §8.4 u (vLLM gpu_memory_utilization)
    swap_fixed_s: float = 0.5  # §8.7 t_fix (0.2-1 s sleep/wake, 2-10 s framework offload)
    sync_fixed_s: float = 0.3  # §8.8 t_fix (warmed NCCL group)
    sync_bucket_bytes: float = 512 * 1024**2  # §8.8 bucket (slime-style 512 MB)
    sync_rpc_s: float = 0.010  # §8.8 t_rpc per bucket (10-30 ms)
    kv_reinit_s: float = 0.5  # §5/§8.7: engine wake + KV re-allocation (sleep-mode wake range)
    hybrid_state_seqs: int = 128  # sequences whose linear-attention state is reserved (hybrid)

    def __post_init__(self) -> None:
        for key in ("mfu_train", "mfu_fwd", "kv_mem_util"):
            value = getattr(self, key)
            require(0.0 < value <= 1.0, key, f"expected a number in (0, 1], got {short(value)}")
        require_fraction(self.recompute, "recompute")
        for key in ("swap_fixed_s", "sync_fixed_s", "sync_rpc_s", "kv_reinit_s"):
            require_non_negative(getattr(self, key), key)
        require_positive(self.sync_bucket_bytes, "sync_bucket_bytes")
        require_non_negative(self.hybrid_state_seqs, "hybrid_state_seqs")


class CostModel:
    """Durations (seconds) of the simulator's GPU work for one model on one GPU kind."""

    def __init__(self, model: ModelSpec, gpu: GPUSpec | None = None,
                 knobs: CostKnobs | None = None, **overrides: float) -> None:
        """``overrides`` are CostKnobs fields by name (``mfu_train=0.33``, ``swap_fixed_s=5``)."""
        self.model = model
        self.gpu = gpu if gpu is not None else GPUSpec()
        self.knobs = replace(knobs if knobs is not None else CostKnobs(), **overrides)

    # ---- rollout (calibration §8.1-8.4) ----

    def t_lin(self, num_tokens: int) -> float:
        """§8.1: all layers' linear ops over ``num_tokens`` tokens (vidur-fitted soft roofline)."""
        if num_tokens <= 0:
            return 0.0
        two_p = 2.0 * self.model.params_layer
        memory = two_p / self.gpu.hbm_bw
        compute = two_p * num_tokens / self.gpu.gemm_flops
        layer = self.gpu.layer_overhead_s + (memory**1.5 + compute**1.5) ** (2.0 / 3.0)
        return self.model.num_layers * layer

    def t_head(self, num_logits: int) -> float:
        """§8.1: the LM head for ``num_logits`` tokens that need logits."""
        if num_logits <= 0:
            return 0.0
        two_vd = 2.0 * self.model.vocab * self.model.hidden
        return max(two_vd / self.gpu.hbm_bw, two_vd * num_logits / self.gpu.gemm_flops)

    def decode_step_s(self, batch: int, sum_context: int) -> float:
        """§8.2: one engine step over ``batch`` sequences whose contexts sum to ``sum_context``.

        Hybrid models also read and write each sequence's recurrent state once per step.
        """
        if batch <= 0:
            return 0.0
        kv = sum_context * self.model.kv_bytes_per_token / self.gpu.kv_bw
        return (self.gpu.step_overhead_s + self.t_lin(batch) + self.t_head(batch) + kv
                + self._state_s(batch))

    def decode_fixed_s(self, batch: int) -> float:
        """The part of a decode step over ``batch`` sequences that does not grow with their
        contexts: the step's overhead, the linear layers, the LM head, the recurrent state."""
        return (self.gpu.step_overhead_s + self.t_lin(batch) + self.t_head(batch)
                + self._state_s(batch))

    def _state_s(self, batch: int) -> float:
        return 2 * batch * self.model.state_bytes_per_seq / self.gpu.kv_bw

    def kv_read_s_per_token(self) -> float:
        """A decode step's time per context token it reads."""
        return self.model.kv_bytes_per_token / self.gpu.kv_bw

    def prefill_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """§8.3: one prefill pass; ``chunks`` holds (new, cached) tokens per sequence."""
        work = [(new, cached) for new, cached in chunks if new > 0]
        if not work:
            return 0.0
        new_tokens = sum([new for new, _ in work])
        attention = sum([self.attention_flops(new, cached) for new, cached in work])
        return (self.gpu.step_overhead_s + self.t_lin(new_tokens) + self.t_head(len(work))
                + attention / self.gpu.attn_flops)

    def attention_flops(self, new: int, cached: int) -> float:
        """§8.3: 4·L_attn·H·h_d·(n·c + n²/2), causal attention of n new tokens over c cached."""
        width = self.model.num_attention_layers * self.model.attention_width
        return 4.0 * width * (new * cached + new * new / 2.0)

    def activation_peak_bytes(self) -> float:
        """§8.4 A_peak: the model's value, else 5 GiB at d=3584 + 0.5 GiB per 1536 of hidden.

        The line runs through calibration's 7B (5.0) and 14B (5.5) values; it is clamped to the
        4.8-7.4 GiB measured across models (§3.1) so a small model is not given less.
        """
        if self.model.activation_peak_gib is not None:
            return self.model.activation_peak_gib * GIB
        gib = 5.0 + 0.5 * (self.model.hidden - 3584) / 1536
        return min(max(gib, 4.8), 7.4) * GIB

    def kv_capacity_tokens(self) -> int:
        """§8.4: KV tokens of one rollout GPU (TP=1) at utilisation u.

        N_kv = (u·M − W − A_peak − non_torch − state) / b_kv; ``state`` reserves the recurrent
        state of ``hybrid_state_seqs`` sequences for hybrid models (0 for dense ones).
        """
        budget = self.knobs.kv_mem_util * self.gpu.memory_bytes
        state = self.knobs.hybrid_state_seqs * self.model.state_bytes_per_seq
        free = (budget - self.model.weight_bytes - self.activation_peak_bytes()
                - self.gpu.non_torch_bytes - state)
        return max(0, int(free // self.model.kv_bytes_per_token))

    def min_train_gpus(self) -> int:
        """GPUs a colocated trainer needs to hold its state, sharded (FSDP/ZeRO-3 style).

        Mixed-precision AdamW keeps 16 B/param (bf16 weights and grads, fp32 master, m, v;
        calibration §5) and the colocated Ref adds 2 B/param; each GPU also keeps A_peak free.
        """
        state = TRAIN_STATE_BYTES_PER_PARAM * self.model.params_total
        per_gpu = self.gpu.memory_bytes - self.activation_peak_bytes()
        return max(1, math.ceil(state / per_gpu))

    # ---- training and reference (calibration §8.5-8.6) ----

    def _train_flops_per_token(self, seq_len: int) -> float:
        """§8.5 with r = 0: 6·N_mm + 12·L_attn·H·h_d·s."""
        width = self.model.num_attention_layers * self.model.attention_width
        return 6.0 * self.model.params_matmul + 12.0 * width * seq_len

    def train_token_s(self, seq_len: int) -> float:
        """§8.5: actor fwd+bwd per token at sequence length ``seq_len``, one GPU."""
        recompute = self.knobs.recompute * 2.0 * self.model.params_matmul
        flops = self._train_flops_per_token(seq_len) + recompute
        return flops / (self.knobs.mfu_train * self.gpu.peak_flops)

    def actor_fwd_s(self, tokens: int, seq_len: int) -> float:
        """Forward share of training: 1/3 of the r=0 fwd+bwd FLOPs, at the training MFU."""
        share = self._train_flops_per_token(seq_len) / 3.0
        return tokens * share / (self.knobs.mfu_train * self.gpu.peak_flops)

    def actor_bwd_s(self, tokens: int, seq_len: int) -> float:
        """Backward: the rest of training (2/3 of the FLOPs, plus any recompute)."""
        return tokens * self.train_token_s(seq_len) - self.actor_fwd_s(tokens, seq_len)

    def ref_fwd_s(self, tokens: int, seq_len: int) -> float:
        """§8.6: reference / old-logprob forward, [2·N_mm + 4·L_attn·H·h_d·s] / (MFU_f·peak)."""
        flops = self._train_flops_per_token(seq_len) / 3.0
        return tokens * flops / (self.knobs.mfu_fwd * self.gpu.peak_flops)

    # ---- swaps, weight sync, role switches (calibration §8.7-8.8) ----

    def swap_s(self, nbytes: float) -> float:
        """§8.7: t_fix + bytes / BW_pcie, one direction."""
        return self.knobs.swap_fixed_s + nbytes / self.gpu.pcie_bw

    def model_swap_s(self) -> float:
        """Offload one model's weights while loading another's of the same size, overlapped.

        Both directions at once share the duplex bandwidth (83.4 GB/s total, §2), so the pair
        takes max(W / BW_pcie, 2W / BW_duplex) plus one t_fix.
        """
        nbytes = self.model.weight_bytes
        transfer = max(nbytes / self.gpu.pcie_bw, 2 * nbytes / self.gpu.pcie_duplex_bw)
        return self.knobs.swap_fixed_s + transfer

    def weight_sync_s(self, num_targets: int, cross_node: bool) -> float:
        """§8.8: trainer -> ``num_targets`` rollout engines, bucketed NCCL broadcast.

        t_fix + ceil(W/bucket)·t_rpc + W/BW + (k−1)·bucket/BW (pipelined broadcast), with BW the
        NVLink P2P rate inside a node and one IB stream across nodes.
        """
        if num_targets <= 0:
            return 0.0
        knobs = self.knobs
        nbytes = self.model.weight_bytes
        bandwidth = self.gpu.ib_bw if cross_node else self.gpu.nvlink_bw
        buckets = math.ceil(nbytes / knobs.sync_bucket_bytes)
        pipeline = (num_targets - 1) * min(knobs.sync_bucket_bytes, nbytes) / bandwidth
        return knobs.sync_fixed_s + buckets * knobs.sync_rpc_s + nbytes / bandwidth + pipeline

    def role_switch_s(self, src: Role, dst: Role) -> float:
        """Extra time for an ERS role move at the sync boundary, beyond the weight sync.

        To REF or ACTOR: load that model's weights from host memory (``swap_s(W)``); the rollout
        engine's memory is released, not copied out. To ROLLOUT: the actor weights arrive with the
        weight sync itself, so only the engine's wake and KV re-allocation (``kv_reinit_s``) is
        added. To IDLE, or no move: 0.
        """
        if src == dst or dst == Role.IDLE:
            return 0.0
        if dst == Role.ROLLOUT:
            return self.knobs.kv_reinit_s
        return self.swap_s(self.model.weight_bytes)
