"""The library half of ``tiderl measure kv|readiness`` (the CLI only parses and prints):

    measure kv:         GET <url>/metrics every interval ──read_kv──> KVReading ──kv_sample──> rows
                        (an engine's page: TideRL, vLLM, SGLang; or the job's coordinator)
    measure readiness:  runs/<job>/metrics.jsonl ──> per-step RAS/TPRM rows + the RAS/TPRM PNG

Plots reuse :mod:`tiderl.runtime.report`'s matplotlib (Agg) helpers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from tiderl.core.records import StepRecord
from tiderl.launch.kv_sources import KVSample, KVSourceError, kv_sample, read_kv
from tiderl.launch.local import JobRecord
from tiderl.runtime.report import pyplot, save_figure


class MeasureError(RuntimeError):
    """What stops a measurement: an endpoint that does not answer or is not a known source."""


class EndpointUnreachable(MeasureError):
    """No HTTP answer at all (nothing listens there, or it timed out)."""


@dataclass(frozen=True, slots=True)
class KVSeries:
    url: str
    source: str
    interval_s: float
    samples: list[KVSample]

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "source": self.source, "interval_s": self.interval_s,
                "samples": [asdict(s) for s in self.samples]}


def engine_metrics_url(base_url: str) -> str:
    """An engine's Prometheus page: ``base_url`` itself if it already ends in /metrics."""
    url = base_url.rstrip("/")
    return url if url.endswith("/metrics") else f"{url}/metrics"


def job_metrics_url(job: JobRecord) -> str:
    url = job.info.get("metrics")
    if not url:
        raise MeasureError(f"job {job.job_id} has no metrics endpoint in its job.json")
    return str(url)


def scrape(url: str, timeout_s: float = 5.0) -> str:
    try:
        response = httpx.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise EndpointUnreachable(f"cannot read {url}: {exc or type(exc).__name__}") from None
    if response.status_code != 200:
        raise MeasureError(f"{url} answered HTTP {response.status_code}")
    return response.text


def measure_kv(url: str, duration_s: float, interval_s: float,
               fetch: Callable[[str], str] = scrape,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep,
               on_start: Callable[[str], None] | None = None) -> KVSeries:
    """A baseline scrape at t=0, then one sample every ``interval_s`` up to ``duration_s``
    (at least one), each with the hit rate over the interval before it. ``on_start(source)``
    is called once the baseline scrape is read (a progress note)."""
    if interval_s <= 0 or duration_s < interval_s:
        raise MeasureError(f"need 0 < interval ({interval_s} s) <= duration ({duration_s} s)")
    start = clock()
    before = _read(url, fetch)
    if on_start is not None:
        on_start(before.source)
    samples = []
    for k in range(1, int(duration_s / interval_s + 1e-9) + 1):
        sleep(max(0.0, start + k * interval_s - clock()))
        now = _read(url, fetch)
        samples.append(kv_sample(round(clock() - start, 3), before, now))
        before = now
    return KVSeries(url, before.source, interval_s, samples)


def _read(url: str, fetch: Callable[[str], str]):
    try:
        return read_kv(fetch(url))
    except KVSourceError as exc:
        raise MeasureError(f"{url}: {exc}") from None


def plot_kv(series: KVSeries, path: Path) -> Path:
    """KV usage and hit rate over time, one panel each."""
    plt = pyplot()
    t = [s.t_s for s in series.samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(t, [_nan(s.usage) for s in series.samples], marker=".", linewidth=1.2)
    top.set_ylabel("KV usage (fraction)")
    top.set_title(f"KV cache: {series.source} ({series.url})")
    bottom.plot(t, [_nan(s.hit_rate) for s in series.samples], marker=".", linewidth=1.2)
    bottom.set_ylabel("prefix hit rate")
    for ax in (top, bottom):
        ax.set_ylim(0.0, 1.05)
    bottom.set_xlabel("time (s)")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path)
    return path


def readiness_rows(metrics: list[StepRecord]) -> list[dict[str, Any]]:
    """Per step: RAS, TPRM (None when the step saw fewer than two ready micro-batches), the
    mode, micro-batches and duration, from metrics.jsonl records."""
    return [{"step": m.step, "ras": m.ras, "tprm_s": m.tprm_s, "step_mode": m.step_mode.value,
             "num_micro_batches": m.num_micro_batches, "step_s": round(m.step_s, 3)}
            for m in metrics]


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value
