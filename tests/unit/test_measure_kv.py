"""Parsing the KV metrics of each source ``tiderl measure kv`` knows, and its sampling loop.

The vLLM and SGLang pages are recorded formats (names, types and labels as their servers print
them: vLLM ``vllm/v1/metrics/loggers.py``, SGLang ``srt/metrics/collector.py`` and its
production-metrics docs); the TideRL ones come from our own exporters.
"""

import pytest
from prometheus_client import generate_latest

from tiderl.launch.kv_sources import SOURCES, KVSourceError, kv_sample, read_kv
from tiderl.launch.measure import MeasureError, measure_kv
from tiderl.runtime.prom import MetricsExporter

VLLM_LABELS = 'engine="{engine}",model_name="Qwen/Qwen2.5-7B-Instruct"'


def vllm_text(queries: float, hits: float, usage: float, engines: int = 1) -> str:
    """vLLM 0.9-0.10 (V1): the new names and, still exposed, the deprecated gpu_* ones."""
    lines = []
    for name, kind, help_, value in (
            ("vllm:gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. DEPRECATED", usage),
            ("vllm:gpu_prefix_cache_queries", "counter", "DEPRECATED", queries),
            ("vllm:gpu_prefix_cache_hits", "counter", "DEPRECATED", hits),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             usage),
            ("vllm:prefix_cache_queries", "counter",
             "Prefix cache queries, in terms of number of queried tokens.", queries),
            ("vllm:prefix_cache_hits", "counter",
             "Prefix cache hits, in terms of number of cached tokens.", hits)):
        suffix = "_total" if kind == "counter" else ""
        lines += [f"# HELP {name}{suffix} {help_}", f"# TYPE {name}{suffix} {kind}"]
        for engine in range(engines):
            labels = VLLM_LABELS.format(engine=engine)
            each = value if kind == "gauge" else value / engines
            lines.append(f"{name}{suffix}{{{labels}}} {each}")
        if kind == "counter":
            lines += [f"# HELP {name}_created {help_}", f"# TYPE {name}_created gauge"]
            lines += [f"{name}_created{{{VLLM_LABELS.format(engine=e)}}} 1.7329e+09"
                      for e in range(engines)]
    return "\n".join([*lines, "# HELP vllm:num_requests_running Number of requests.",
                      "# TYPE vllm:num_requests_running gauge",
                      f"vllm:num_requests_running{{{VLLM_LABELS.format(engine=0)}}} 3.0", ""])


def vllm_v0_text(usage: float, hit_rate: float) -> str:
    """vLLM 0.6 (V0): usage and a block hit-rate gauge, no prefix counters."""
    labels = 'model_name="meta-llama/Llama-2-7b-hf"'
    return (f"# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.\n"
            f"# TYPE vllm:gpu_cache_usage_perc gauge\n"
            f"vllm:gpu_cache_usage_perc{{{labels}}} {usage}\n"
            f"# HELP vllm:gpu_prefix_cache_hit_rate GPU prefix cache block hit rate.\n"
            f"# TYPE vllm:gpu_prefix_cache_hit_rate gauge\n"
            f"vllm:gpu_prefix_cache_hit_rate{{{labels}}} {hit_rate}\n")


def sglang_text(usage: float, hit_rate: float, used: float | None = None,
                total: float | None = None) -> str:
    labels = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'
    lines = ["# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
             "# TYPE sglang:prompt_tokens_total counter",
             f"sglang:prompt_tokens_total{{{labels}}} 8.128902e+06",
             "# HELP sglang:token_usage The token usage.", "# TYPE sglang:token_usage gauge",
             f"sglang:token_usage{{{labels}}} {usage}",
             "# HELP sglang:cache_hit_rate The prefix cache hit rate.",
             "# TYPE sglang:cache_hit_rate gauge",
             f"sglang:cache_hit_rate{{{labels}}} {hit_rate}"]
    if used is not None:
        lines += ["# TYPE sglang:num_used_tokens gauge",
                  f"sglang:num_used_tokens{{{labels}}} {used}",
                  "# TYPE sglang:max_total_num_tokens gauge",
                  f"sglang:max_total_num_tokens{{{labels}}} {total}"]
    return "\n".join([*lines, ""])


def tiderl_engine_text(queries: float, hits: float, usage: float) -> str:
    """What tiderl/engine/server.py's EngineCollector prints (counters gain _total)."""
    return ("# HELP tiderl:prefix_cache_queries_total Prompt tokens looked up.\n"
            "# TYPE tiderl:prefix_cache_queries_total counter\n"
            f"tiderl:prefix_cache_queries_total {queries}\n"
            "# HELP tiderl:prefix_cache_hits_total Prompt tokens found in the cache.\n"
            "# TYPE tiderl:prefix_cache_hits_total counter\n"
            f"tiderl:prefix_cache_hits_total {hits}\n"
            "# HELP tiderl:kv_cache_usage_perc Fraction of KV blocks referenced.\n"
            "# TYPE tiderl:kv_cache_usage_perc gauge\n"
            f"tiderl:kv_cache_usage_perc {usage}\n")


def coordinator_text(hit_rate: float | None, kv: dict[int, tuple[int, int]]) -> str:
    exporter = MetricsExporter()
    exporter.update_live(rwt_s_total=0.0, ras=0, tprm_s=None, roles=["rollout"] * len(kv),
                         kv_tokens=kv, ctb_budgets={r: capacity * 9 // 10
                                                    for r, (_, capacity) in kv.items()})
    exporter.update_step(trained_tokens_total=10, twt_s_total=0.0, kv_hit_rate=hit_rate,
                         staleness=0, step_mode="colocated")
    return generate_latest(exporter.registry).decode()


# -- one reading per source ----------------------------------------------------------------------

def test_vllm_v1_prefers_the_new_names_and_sums_engines():
    reading = read_kv(vllm_text(queries=1000, hits=400, usage=0.25, engines=2))
    assert reading.source == "vllm"
    assert (reading.usage, reading.queries, reading.hits) == (0.25, 1000, 400)
    assert reading.hit_rate is None


def test_vllm_07_gpu_names_alone():
    text = "\n".join(line for line in vllm_text(100, 30, 0.5).splitlines()
                     if "vllm:kv_cache" not in line and "vllm:prefix_cache" not in line)
    reading = read_kv(text + "\n")
    assert reading.source == "vllm (0.7-0.8)"
    assert (reading.usage, reading.queries, reading.hits) == (0.5, 100, 30)


def test_vllm_v0_hit_rate_gauge():
    reading = read_kv(vllm_v0_text(usage=0.125, hit_rate=0.6))
    assert reading.source == "vllm (v0)"
    assert (reading.usage, reading.hit_rate, reading.queries) == (0.125, 0.6, None)


def test_sglang_gauges():
    reading = read_kv(sglang_text(usage=0.28, hit_rate=0.0075, used=2800, total=10000))
    assert reading.source == "sglang"
    assert (reading.usage, reading.hit_rate) == (0.28, 0.0075)
    assert (reading.used_tokens, reading.capacity_tokens) == (2800, 10000)
    assert read_kv(sglang_text(0.5, 0.1)).used_tokens is None  # older SGLang


def test_tiderl_engine_counters():
    reading = read_kv(tiderl_engine_text(queries=64, hits=48, usage=0.0625))
    assert reading.source == "tiderl engine"
    assert (reading.usage, reading.queries, reading.hits) == (0.0625, 64, 48)


def test_tiderl_coordinator_sums_rollout_ranks():
    reading = read_kv(coordinator_text(0.75, {0: (100, 1000), 2: (300, 1000)}))
    assert reading.source == "tiderl coordinator"
    assert (reading.used_tokens, reading.capacity_tokens, reading.hit_rate) == (400, 2000, 0.75)
    sample = kv_sample(1.0, reading, reading)
    assert (sample.usage, sample.hit_rate, sample.hit_rate_kind) == (0.2, 0.75, "gauge")
    assert read_kv(coordinator_text(None, {0: (0, 10)})).hit_rate is None  # NaN: unknown


def test_a_coordinator_before_its_first_rank_report_is_still_recognized():
    reading = read_kv(coordinator_text(None, {}))
    assert reading.source == "tiderl coordinator"
    assert (reading.used_tokens, reading.hit_rate) == (None, None)
    assert kv_sample(0.5, reading, reading).usage is None


def test_every_source_is_recognized_by_its_own_names():
    assert len({s.name for s in SOURCES}) == len(SOURCES)


@pytest.mark.parametrize("text", ["", "# just a comment\n", "up 1\nprocess_cpu_seconds 2\n"])
def test_unknown_pages_name_what_was_expected(text):
    with pytest.raises(KVSourceError, match=r"no KV-cache metrics found.*vllm:kv_cache_usage_perc"
                       r".*sglang:token_usage"):
        read_kv(text)


def test_html_is_not_prometheus_text():
    with pytest.raises(KVSourceError, match="not Prometheus text"):
        read_kv("<html><body>Not found</body></html>\n")


# -- rates ---------------------------------------------------------------------------------------

def test_interval_rate_from_counters():
    before = read_kv(tiderl_engine_text(100, 50, 0.1))
    after = read_kv(tiderl_engine_text(300, 200, 0.2))
    sample = kv_sample(2.0, before, after)
    assert (sample.t_s, sample.usage, sample.hit_rate, sample.hit_rate_kind) == (
        2.0, 0.2, 0.75, "interval")
    assert kv_sample(3.0, after, after).hit_rate is None  # no lookups in the interval


def test_a_counter_reset_counts_from_zero():
    before = read_kv(vllm_text(1000, 900, 0.5))
    after = read_kv(vllm_text(40, 10, 0.5))  # the server restarted
    assert kv_sample(1.0, before, after).hit_rate == 0.25


# -- the sampling loop (scrapes injected; the HTTP path is in tests/integration) -----------------

class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def test_measure_kv_samples_on_a_grid_with_interval_rates():
    clock = FakeClock()
    pages = iter(tiderl_engine_text(q, h, u) for q, h, u in (
        (0, 0, 0.0), (100, 50, 0.25), (100, 50, 0.25), (300, 250, 0.5), (400, 250, 0.5)))
    result = measure_kv("http://x/metrics", duration_s=2.0, interval_s=0.5,
                        fetch=lambda url: next(pages), clock=clock, sleep=clock.sleep)
    assert result.source == "tiderl engine"
    assert [s.t_s for s in result.samples] == [0.5, 1.0, 1.5, 2.0]
    assert [s.usage for s in result.samples] == [0.25, 0.25, 0.5, 0.5]
    assert [s.hit_rate for s in result.samples] == [0.5, None, 1.0, 0.0]
    assert result.to_dict()["samples"][0]["hit_rate_kind"] == "interval"


def test_measure_kv_reports_an_unknown_page_with_its_url():
    with pytest.raises(MeasureError, match=r"^http://x/metrics: no KV-cache metrics found"):
        measure_kv("http://x/metrics", 1.0, 0.5, fetch=lambda url: "up 1\n",
                   clock=FakeClock(), sleep=lambda s: None)


def test_measure_kv_rejects_a_bad_interval():
    with pytest.raises(MeasureError, match="interval"):
        measure_kv("http://x", 0.5, 1.0, fetch=lambda url: "")
