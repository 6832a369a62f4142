"""The cost model reproduces simcal's derived figures (within 10%) and behaves monotonically."""

import math

import pytest

from tiderl.core.config import ConfigError
from tiderl.core.types import Role
from tiderl.sim.hardware import GIB, GPUS, MODELS, CostKnobs, CostModel, GPUSpec, ModelSpec

Q7 = MODELS["qwen2.5-7b"]
Q14 = MODELS["qwen2.5-14b"]


def near(value, expected, rel=0.10):
    return value == pytest.approx(expected, rel=rel)


@pytest.fixture
def c7():
    return CostModel(Q7, GPUS["h100-sxm"])


@pytest.fixture
def c14():
    return CostModel(Q14, GPUS["h100-sxm"])


# ---- model shapes (simcal §1, §8) ----

def test_qwen25_derived_sizes_match_simcal():
    assert Q7.params_layer == pytest.approx(233.0e6, rel=1e-3)
    assert Q14.params_layer == pytest.approx(275.3e6, rel=1e-3)
    assert Q7.params_total == pytest.approx(7.616e9, rel=1e-3)
    assert Q14.params_total == pytest.approx(14.770e9, rel=1e-3)
    assert Q7.params_matmul == pytest.approx(7.07e9, rel=2e-3)
    assert Q14.params_matmul == pytest.approx(13.99e9, rel=2e-3)
    assert Q7.weight_bytes / GIB == pytest.approx(14.19, rel=2e-3)
    assert Q14.weight_bytes / GIB == pytest.approx(27.51, rel=2e-3)
    assert Q7.kv_bytes_per_token == 57_344
    assert Q14.kv_bytes_per_token == 196_608


def test_other_models_have_published_sizes():
    vl4 = MODELS["qwen3-vl-4b"]
    q9 = MODELS["qwen3.5-9b"]
    assert 4.0e9 < vl4.params_total < 4.6e9  # "4B" card (4.44 B)
    assert 8.5e9 < q9.params_total < 10.0e9  # "9B" card
    assert q9.num_attention_layers == 8 and q9.num_linear_layers == 24
    assert q9.kv_bytes_per_token == 32_768  # 8 layers x 4 KV heads x 256 x 2 x 2 B
    assert vl4.kv_bytes_per_token == 147_456
    assert q9.state_bytes_per_seq > 0 and Q7.state_bytes_per_seq == 0


def test_gpu_defaults_are_h100():
    gpu = GPUSpec()
    assert gpu.memory_bytes / GIB == pytest.approx(79.18, rel=1e-3)
    assert gpu.gpus_per_node == 8
    assert GPUS["h100-sxm"] == gpu


# ---- rollout (simcal §3, §8.2-8.4) ----

def test_decode_step_b1(c7, c14):
    assert near(c7.decode_step_s(1, 1000), 6.6e-3)
    assert near(c14.decode_step_s(1, 1000), 11.9e-3)


CONTEXTS = (1000, 4000, 8000, 16000)
SIMCAL_DECODE_MS = {  # simcal §3.3 table: batch -> ms per mean context (None: does not fit)
    "qwen2.5-7b": {1: (6.6, 6.7, 6.8, 7.0), 8: (6.8, 7.4, 8.2, 9.9), 32: (7.6, 10.0, 13.3, 19.8),
                   64: (8.7, 13.6, 20.1, None), 128: (11.1, 21.0, None, None),
                   256: (16.6, None, None, None)},
    "qwen2.5-14b": {1: (11.9, 12.1, 12.5, 13.2), 8: (12.5, 14.6, 17.4, 23.0),
                    32: (15.0, 23.4, None, None), 64: (18.4, None, None, None),
                    128: (25.7, None, None, None)},
}


@pytest.mark.parametrize("name", sorted(SIMCAL_DECODE_MS))
def test_decode_table_matches_simcal(name):
    cost = CostModel(MODELS[name])
    for batch, row in SIMCAL_DECODE_MS[name].items():
        for context, ms in zip(CONTEXTS, row, strict=True):
            if ms is not None:
                assert near(cost.decode_step_s(batch, batch * context) * 1e3, ms, 0.03)


def test_decode_grows_with_batch_and_context(c7):
    steps = [c7.decode_step_s(b, b * 2000) for b in (1, 2, 8, 32, 128, 512)]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    by_context = [c7.decode_step_s(16, s) for s in (0, 1000, 10_000, 100_000)]
    assert by_context == sorted(by_context) and len(set(by_context)) == len(by_context)
    assert c7.decode_step_s(0, 0) == 0.0


def test_prefill_matches_simcal(c7, c14):
    assert near(c7.prefill_s([(2048, 0)]), 47e-3)
    assert near(c7.prefill_s([(8192, 0)]), 204e-3)
    assert near(c7.prefill_s([(32768, 0)]), 1.21)
    assert near(c14.prefill_s([(2048, 0)]), 95e-3)
    assert near(c14.prefill_s([(8192, 0)]), 425e-3)


def test_prefill_cached_context_costs_attention_only(c7):
    fresh = c7.prefill_s([(512, 0)])
    on_cache = c7.prefill_s([(512, 8000)])
    extra = 4 * Q7.num_layers * Q7.attention_width * 512 * 8000 / c7.gpu.attn_flops
    assert on_cache - fresh == pytest.approx(extra)
    assert c7.prefill_s([]) == 0.0 and c7.prefill_s([(0, 100)]) == 0.0


def test_prefill_batches_linear_work_once(c7):
    two = c7.prefill_s([(1024, 0), (1024, 0)])
    assert two < 2 * c7.prefill_s([(1024, 0)])  # one T0 and one weight read
    assert two < c7.prefill_s([(2048, 0)])  # same linear work, less attention
    attention = 2 * 4 * Q7.num_layers * Q7.attention_width * 1024**2 / 2 / c7.gpu.attn_flops
    expected = c7.gpu.step_overhead_s + c7.t_lin(2048) + c7.t_head(2) + attention
    assert two == pytest.approx(expected)


def test_kv_capacity_matches_simcal():
    assert near(CostModel(Q7).kv_capacity_tokens(), 0.97e6)
    assert near(CostModel(Q14).kv_capacity_tokens(), 0.21e6)
    assert near(CostModel(Q7, kv_mem_util=0.5).kv_capacity_tokens(), 0.37e6)
    assert near(CostModel(Q14, kv_mem_util=0.5).kv_capacity_tokens(), 36e3)


def test_activation_rule_passes_through_the_anchors():
    rule = ModelSpec("x", 28, 3584, 28, 4, 128, 18944, 152064)
    assert CostModel(rule).activation_peak_bytes() == pytest.approx(5.0 * GIB)
    wide = ModelSpec("y", 48, 5120, 40, 8, 128, 13824, 152064)
    assert CostModel(wide).activation_peak_bytes() == pytest.approx(5.5 * GIB)
    small = CostModel(MODELS["qwen3-vl-4b"]).activation_peak_bytes()
    assert small == pytest.approx(4.8 * GIB)  # clamped to the measured floor


def test_hybrid_capacity_reserves_recurrent_state():
    q9 = MODELS["qwen3.5-9b"]
    none = CostModel(q9, hybrid_state_seqs=0).kv_capacity_tokens()
    some = CostModel(q9, hybrid_state_seqs=128).kv_capacity_tokens()
    assert none - some == pytest.approx(128 * q9.state_bytes_per_seq / q9.kv_bytes_per_token, 1)


# ---- training (simcal §4, §8.5-8.6) ----

def test_training_matches_simcal(c7, c14):
    assert near(c7.train_token_s(8192), 139e-6)
    assert near(c14.train_token_s(8192), 288e-6)
    assert near(1 / CostModel(Q7, mfu_train=0.33).train_token_s(8192), 6.2e3)
    assert near(1 / CostModel(Q7, mfu_train=0.45).train_token_s(8192), 8.5e3)


def test_reference_forward_matches_simcal(c7, c14):
    assert near(c7.ref_fwd_s(1, 8192), 46e-6)
    assert near(c14.ref_fwd_s(1, 8192), 96e-6)
    assert near(1 / c7.ref_fwd_s(1, 8192), 21.6e3)


def test_actor_forward_is_a_third_of_training(c7):
    tokens, seq = 4096, 8192
    total = tokens * c7.train_token_s(seq)
    assert c7.actor_fwd_s(tokens, seq) == pytest.approx(total / 3)
    assert c7.actor_bwd_s(tokens, seq) == pytest.approx(2 * total / 3)
    assert c7.actor_fwd_s(tokens, seq) == pytest.approx(c7.ref_fwd_s(tokens, seq))


def test_full_recompute_goes_to_backward(c7):
    full = CostModel(Q7, recompute=1.0)
    assert full.actor_fwd_s(100, 8192) == pytest.approx(c7.actor_fwd_s(100, 8192))
    assert full.actor_bwd_s(100, 8192) > c7.actor_bwd_s(100, 8192)


# ---- swap, sync, role switches (simcal §5, §6, §8.7-8.8) ----

def test_swap_formula(c7, c14):
    assert c7.knobs.swap_fixed_s == 0.5
    assert c7.swap_s(Q7.weight_bytes) - 0.5 == pytest.approx(0.30, rel=0.05)
    assert c14.swap_s(Q14.weight_bytes) - 0.5 == pytest.approx(0.59, rel=0.05)
    assert CostModel(Q7, swap_fixed_s=5.0).swap_s(0) == 5.0
    assert c7.swap_s(1e9) == pytest.approx(0.5 + 1e9 / 50e9)


def test_model_swap_uses_duplex_bandwidth(c7):
    w = Q7.weight_bytes
    assert c7.model_swap_s() == pytest.approx(0.5 + 2 * w / 83.4e9)
    assert c7.swap_s(w) < c7.model_swap_s() < c7.swap_s(2 * w)


def test_weight_sync_formula(c7):
    w = Q7.weight_bytes
    bucket = 512 * 1024**2
    buckets = math.ceil(w / bucket)
    inside = c7.weight_sync_s(1, cross_node=False)
    assert inside == pytest.approx(0.3 + buckets * 0.010 + w / 340e9)
    across = c7.weight_sync_s(8, cross_node=True)
    assert across == pytest.approx(0.3 + buckets * 0.010 + w / 35e9 + 7 * bucket / 35e9)
    assert 0.5 <= inside <= 0.8  # simcal §8.8 default, 7B inside a node
    assert 0.8 <= across <= 1.5  # across nodes
    assert c7.weight_sync_s(0, cross_node=True) == 0.0
    assert c7.weight_sync_s(4, True) > c7.weight_sync_s(2, True) > c7.weight_sync_s(2, False)


def test_role_switch_costs(c7):
    load = c7.swap_s(Q7.weight_bytes)
    assert c7.role_switch_s(Role.ROLLOUT, Role.REF) == pytest.approx(load)
    assert c7.role_switch_s(Role.ROLLOUT, Role.ACTOR) == pytest.approx(load)
    assert c7.role_switch_s(Role.REF, Role.ACTOR) == pytest.approx(load)
    assert c7.role_switch_s(Role.ACTOR, Role.ROLLOUT) == c7.knobs.kv_reinit_s
    assert c7.role_switch_s(Role.REF, Role.ROLLOUT) == c7.knobs.kv_reinit_s
    assert c7.role_switch_s(Role.ROLLOUT, Role.ROLLOUT) == 0.0
    assert c7.role_switch_s(Role.ACTOR, Role.IDLE) == 0.0


def test_knobs_are_validated():
    with pytest.raises(ConfigError, match="mfu_train"):
        CostKnobs(mfu_train=0.0)
    with pytest.raises(ConfigError, match="swap_fixed_s"):
        CostModel(Q7, swap_fixed_s=-1.0)
    with pytest.raises(TypeError):
        CostModel(Q7, no_such_knob=1.0)
