"""effective_config: the one place a policy's config is made what a system runs, rule by rule,
and the view of it that `tiderl launch --dry-run` and `tiderl sim --dry-run` print."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tiderl.core.ctb import CTBConfig
from tiderl.core.ers import ERSConfig
from tiderl.core.job import JobShape
from tiderl.core.ra2p import RA2PConfig
from tiderl.core.step_control import (
    LayoutLimits,
    Substrate,
    effective_config,
    effective_ctb,
    effective_view,
)
from tiderl.core.system import System, SystemSpec
from tiderl.profile import load_profile
from tiderl.runtime.step_config import profile_effective_view, profile_step_config

JOB = JobShape(steps=4, group_size=4, batch_groups=8, batch_min_groups=2, max_staleness=1)
CTB, RA2P, ERS = CTBConfig(), RA2PConfig(), ERSConfig()
SUBSTRATE = Substrate(kv_tokens=10_000, max_new_tokens=32)


def run(system: System | SystemSpec, substrate: Substrate = SUBSTRATE, ra2p: RA2PConfig = RA2P,
        ers: ERSConfig = ERS):
    spec = system if isinstance(system, SystemSpec) else SystemSpec(system)
    return effective_config(spec, JOB, CTB, ra2p, ers, substrate)


def test_tiderl_runs_the_profile_as_given_with_its_derived_figures():
    config = run(System.TIDERL)
    assert (config.ctb, config.ra2p, config.ers) == (CTB, RA2P, ERS)
    assert (config.rank_budget, config.max_new_tokens) == (9000, 32)  # 0.9 of the KV
    assert (config.window_tasks, config.max_staleness, config.has_ers) == (32, 1, True)


@pytest.mark.parametrize("system", [System.SYNC, System.ASYNC, System.STREAM])
def test_a_baseline_rolls_out_request_level_and_never_runs_decoupled(system):
    config = run(system, ra2p=RA2PConfig(placement="decoupled"))
    assert config.ctb == replace(CTB, policy="request")
    assert config.ra2p.placement == "colocated"
    assert not config.has_ers
    assert config.max_staleness == (0 if system is System.SYNC else 1)


def test_the_ablations_switch_one_part_off():
    no_ctb = run(SystemSpec(System.TIDERL, ctb=False))
    assert no_ctb.ctb.policy == "request" and no_ctb.has_ers
    no_ra2p = run(SystemSpec(System.TIDERL, ra2p=False), ra2p=RA2PConfig(placement="auto"))
    assert no_ra2p.ra2p.placement == "colocated" and no_ra2p.ctb == CTB  # ERS: no Ref rank
    assert not run(SystemSpec(System.TIDERL, ers=False)).has_ers
    assert not run(System.TIDERL, ers=ERSConfig(enabled=False)).has_ers


def test_without_a_kl_term_auto_is_colocated_and_a_fixed_placement_stays():
    no_kl = replace(SUBSTRATE, has_kl=False)
    assert run(System.TIDERL, no_kl).ra2p.placement == "colocated"
    fixed = run(System.TIDERL, no_kl, ra2p=RA2PConfig(placement="decoupled"))
    assert fixed.ra2p.placement == "decoupled"


def test_the_simulators_substrate_fixes_the_engines_and_the_baselines_own_knobs():
    sim = replace(SUBSTRATE, request_concurrency=256, stream_tokens_per_rank=1024,
                  min_trainer_ranks=3, over_provision=2.0)
    stream, asynchronous, tiderl = run(System.STREAM, sim), run(System.ASYNC, sim), \
        run(System.TIDERL, sim)
    assert stream.ra2p.tokens_per_rank == 1024 != tiderl.ra2p.tokens_per_rank
    assert {c.ctb.request_concurrency for c in (stream, asynchronous, tiderl)} == {256}
    assert tiderl.ers.min_trainer_ranks == 3
    assert run(System.TIDERL, sim, ers=ERSConfig(min_trainer_ranks=5)).ers.min_trainer_ranks == 5
    # APRIL: the window of (1 + 2) batches of 32 tasks, counted as 2 of 48
    assert (asynchronous.window_tasks, stream.window_tasks, tiderl.window_tasks) == (48, 32, 32)


def test_the_substrates_limits_and_saves_are_carried_through():
    limits = LayoutLimits(grouped_ranks=4, sharded_actor_backend="fsdp2")
    config = run(System.TIDERL, replace(SUBSTRATE, limits=limits, checkpoint_every=2,
                                        export_every=3, tensor_parallel=2))
    assert (config.limits, config.checkpoint_every, config.export_every,
            config.tensor_parallel) == (limits, 2, 3, 2)


def test_effective_ctb_changes_only_what_it_is_given():
    assert effective_ctb(CTB) is CTB
    assert effective_ctb(CTB, policy="ctb") is CTB
    assert effective_ctb(CTB, policy="request", request_concurrency=8) == replace(
        CTB, policy="request", request_concurrency=8)


def test_the_view_names_each_rewritten_key_with_both_values():
    view = effective_view(run(System.ASYNC, ra2p=RA2PConfig(placement="decoupled")), CTB,
                          RA2PConfig(placement="decoupled"), ERS)
    assert view["system"] == "async"
    assert view["changes"] == {"ctb.policy": ["ctb", "request"],
                               "ra2p.placement": ["decoupled", "colocated"]}
    assert (view["rank_budget_tokens"], view["window_tasks"], view["has_ers"]) == (9000, 32,
                                                                                   False)
    assert effective_view(run(System.TIDERL), CTB, RA2P, ERS)["changes"] == {}


def test_a_profile_goes_through_the_same_function():
    profile = load_profile("local", ["runtime.system=stream", "trainer.kl_beta=0"])
    config = profile_step_config(profile)
    assert config.job == profile.job and config.ctb.policy == "request"
    assert profile_effective_view(profile)["changes"] == {
        "ctb.policy": ["ctb", "request"], "ra2p.placement": ["auto", "colocated"]}


def test_ranks_that_share_their_cores_lend_none_at_a_cold_start_and_move_none_on_a_deficit():
    shared = replace(SUBSTRATE, shared_cores=True)
    assert (run(System.TIDERL, shared).ers.cold_start_steps,
            run(System.TIDERL, shared).ers.signal_moves) == (0, False)
    assert run(System.TIDERL).ers.cold_start_steps == ERS.cold_start_steps == 1
    assert run(System.TIDERL).ers.signal_moves is ERS.signal_moves is True
    assert run(System.ASYNC, shared).ers == ERS  # no ERS: nothing to rewrite
    assert effective_view(run(System.TIDERL, shared), CTB, RA2P, ERS)["changes"] == {
        "ers.cold_start_steps": [1, 0], "ers.signal_moves": [True, False]}
    # CPU ranks share the host's cores unless each is pinned to its own
    local = profile_step_config(load_profile("local", [])).ers
    assert (local.cold_start_steps, local.signal_moves) == (0, False)
    pinned = profile_step_config(load_profile("local", ["runtime.cpu_affinity=spread"])).ers
    assert (pinned.cold_start_steps, pinned.signal_moves) == (1, True)
    served = load_profile("local", ["engine.backend=http"])  # each rank's engine is a server's
    assert profile_step_config(served).ers.signal_moves is True
