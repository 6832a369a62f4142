"""The coordinator's Prometheus exporter, read back through its exposition text."""

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiderl.core.system import StepMode
from tiderl.runtime.prom import ROLES, STEP_MODES, MetricsExporter

NAMES = ("tiderl_goodput_tokens_total", "tiderl_trained_tokens_total", "tiderl_ras",
         "tiderl_tprm_seconds", "tiderl_rwt_seconds_total", "tiderl_twt_seconds_total",
         "tiderl_step_mode", "tiderl_ranks", "tiderl_kv_hit_rate", "tiderl_staleness")


def exposed(exporter: MetricsExporter) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the exporter's /metrics text."""
    text = generate_latest(exporter.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def step(exporter, trained=0, twt=0.0, hit=None, staleness=0, step_mode="colocated"):
    exporter.update_step(trained_tokens_total=trained, twt_s_total=twt, kv_hit_rate=hit,
                         staleness=staleness, step_mode=step_mode)


def live(exporter, rwt=0.0, ras=0, tprm=None, roles=(), kv=None, budgets=None):
    exporter.update_live(rwt_s_total=rwt, ras=ras, tprm_s=tprm, roles=list(roles),
                         kv_tokens=kv or {}, ctb_budgets=budgets or {})


def test_the_modes_are_the_step_modes():
    assert tuple(mode.value for mode in StepMode) == STEP_MODES


def test_a_fresh_exporter_has_every_series_with_unknowns_as_nan():
    samples = exposed(MetricsExporter())
    names = {name for name, _ in samples}
    assert set(NAMES) <= names
    assert value(samples, "tiderl_trained_tokens_total") == 0
    assert math.isnan(value(samples, "tiderl_tprm_seconds"))
    assert math.isnan(value(samples, "tiderl_kv_hit_rate"))
    assert all(value(samples, "tiderl_step_mode", step_mode=m) == 0 for m in STEP_MODES)
    assert all(value(samples, "tiderl_ranks", role=r) == 0 for r in ROLES)


def test_updates_show_in_the_text():
    exporter = MetricsExporter()
    live(exporter, rwt=1.5, ras=3, tprm=0.25, roles=["rollout", "actor", "actor", "ref"],
         kv={0: (100, 2048)}, budgets={0: 1843})
    step(exporter, trained=640, twt=2.0, hit=0.75, staleness=2, step_mode="decoupled")
    s = exposed(exporter)
    assert value(s, "tiderl_trained_tokens_total") == 640
    assert value(s, "tiderl_goodput_tokens_total") == 640
    assert value(s, "tiderl_rwt_seconds_total") == 1.5
    assert value(s, "tiderl_twt_seconds_total") == 2.0
    assert value(s, "tiderl_ras") == 3
    assert value(s, "tiderl_tprm_seconds") == 0.25
    assert value(s, "tiderl_kv_hit_rate") == 0.75
    assert value(s, "tiderl_staleness") == 2
    assert {m: value(s, "tiderl_step_mode", step_mode=m) for m in STEP_MODES} == {
        "colocated": 0, "decoupled": 1, "vs": 0, "vso": 0, "batch": 0}
    assert {r: value(s, "tiderl_ranks", role=r) for r in ROLES} == {
        "rollout": 1, "ref": 1, "actor": 2, "idle": 0}
    assert value(s, "tiderl_kv_tokens_used", rank="0") == 100
    assert value(s, "tiderl_kv_tokens_capacity", rank="0") == 2048
    assert value(s, "tiderl_ctb_budget_tokens", rank="0") == 1843


def test_counters_follow_totals_and_never_go_down():
    exporter = MetricsExporter()
    seen = []
    for trained, twt, rwt in ((100, 1.0, 0.5), (250, 1.5, 0.5), (200, 1.0, 0.25), (400, 3.0, 2)):
        step(exporter, trained=trained, twt=twt)
        live(exporter, rwt=rwt)
        s = exposed(exporter)
        seen.append(tuple(value(s, n) for n in (
            "tiderl_trained_tokens_total", "tiderl_twt_seconds_total",
            "tiderl_rwt_seconds_total")))
    assert seen == [(100, 1.0, 0.5), (250, 1.5, 0.5), (250, 1.5, 0.5), (400, 3.0, 2.0)]


def test_mode_switches_and_unknown_hit_rate_is_nan():
    exporter = MetricsExporter()
    step(exporter, hit=0.5, step_mode="decoupled")
    step(exporter, hit=None, step_mode="vso")
    s = exposed(exporter)
    assert {m for m in STEP_MODES if value(s, "tiderl_step_mode", step_mode=m) == 1} == {"vso"}
    assert math.isnan(value(s, "tiderl_kv_hit_rate"))


def test_roles_and_kv_ranks_follow_the_layout():
    exporter = MetricsExporter()
    live(exporter, roles=["rollout", "rollout", "actor"], kv={0: (10, 100), 1: (20, 100)},
         budgets={0: 90, 1: 90})
    live(exporter, roles=["rollout", "ref", "actor"], kv={0: (30, 100)}, budgets={0: 80})
    s = exposed(exporter)
    assert [value(s, "tiderl_ranks", role=r) for r in ROLES] == [1, 1, 1, 0]
    assert value(s, "tiderl_kv_tokens_used", rank="0") == 30
    assert value(s, "tiderl_ctb_budget_tokens", rank="0") == 80
    for name in ("tiderl_kv_tokens_used", "tiderl_kv_tokens_capacity",
                 "tiderl_ctb_budget_tokens"):
        with pytest.raises(KeyError):  # rank 1 left rollout: its series are gone
            value(s, name, rank="1")


def test_a_rank_without_a_ctb_budget_keeps_its_kv_series():
    exporter = MetricsExporter()
    live(exporter, roles=["rollout"], kv={0: (10, 100)}, budgets={0: 90})
    live(exporter, roles=["rollout"], kv={0: (20, 100)})  # not in the book yet, or any more
    s = exposed(exporter)
    assert value(s, "tiderl_kv_tokens_used", rank="0") == 20
    with pytest.raises(KeyError):
        value(s, "tiderl_ctb_budget_tokens", rank="0")
