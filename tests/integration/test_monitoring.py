"""Monitoring against real processes: `tiderl measure kv` against a real `tiderl engine serve` and
recorded vLLM/SGLang pages, and the one-line errors of `profile kv` and `profile readiness`. The
coordinator's /metrics of a running job, and `profile kv` and `profile readiness` of that job:
tests/integration/test_job_control.py (one job for the commands that act on one).

vLLM and SGLang cannot run here: ``FakeVLLMMetricsServer`` and ``FakeSGLangMetricsServer`` are
real HTTP servers that serve their recorded formats (see tests/unit/test_measure_kv.py), with
prefix counters that advance by a fixed amount per scrape.
"""

import asyncio
import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.integration.serving import HUNG_START_S, free_port, serving, tiderl_command
from tests.integration.test_cli import assert_one_line_error, tiderl
from tests.unit.test_measure_kv import sglang_text, vllm_text
from tiderl.engine.clients import TideRLHTTPClient
from tiderl.engine.request import SamplingParams
from tiderl.launch.local import JobRecord
from tiderl.models.random_init import write_random_checkpoint

TEN = ("tiderl_goodput_tokens_total", "tiderl_trained_tokens_total", "tiderl_ras",
       "tiderl_tprm_seconds", "tiderl_rwt_seconds_total", "tiderl_twt_seconds_total",
       "tiderl_step_mode", "tiderl_ranks", "tiderl_kv_hit_rate", "tiderl_staleness")


# -- fake vLLM / SGLang metrics pages ------------------------------------------------------------

class FakeMetricsServer:
    """A real HTTP server on a free loopback port; GET /metrics serves ``page(scrape_number)``."""

    def page(self, n: int) -> str:
        raise NotImplementedError

    def __enter__(self):
        fake = self
        fake.scrapes = 0

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                body = fake.page(fake.scrapes).encode()
                fake.scrapes += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class FakeVLLMMetricsServer(FakeMetricsServer):
    """vLLM V1 on two engines: per scrape, 100 more tokens looked up and 40 of them hit."""

    def page(self, n: int) -> str:
        return vllm_text(queries=1000 + 100 * n, hits=200 + 40 * n, usage=0.25, engines=2)


class FakeSGLangMetricsServer(FakeMetricsServer):
    def page(self, n: int) -> str:
        return sglang_text(usage=0.5, hit_rate=0.125, used=5000, total=10000)


class FakeOtherMetricsServer(FakeMetricsServer):
    def page(self, n: int) -> str:
        return "# TYPE up gauge\nup 1\n"


def measure_kv_json(*args: str) -> dict:
    proc = tiderl("measure", "kv", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_measure_kv_reads_vllm_counters_as_interval_rates(tmp_path):
    png = tmp_path / "kv.png"
    with FakeVLLMMetricsServer() as fake:
        data = measure_kv_json("--engine", fake.url, "--duration", "1", "--interval", "0.5",
                               "--out", str(png))
    assert data["source"] == "vllm"
    assert data["url"] == f"{fake.url}/metrics"
    assert [(s["usage"], s["hit_rate"], s["hit_rate_kind"]) for s in data["samples"]] == [
        (0.25, 0.4, "interval")] * 2
    assert data["png"] == str(png) and png.stat().st_size > 0


def test_measure_kv_reads_sglang_gauges():
    with FakeSGLangMetricsServer() as fake:
        data = measure_kv_json("--engine", fake.url + "/metrics", "--duration", "0.5",
                               "--interval", "0.5")
    assert data["source"] == "sglang"
    sample, = data["samples"]
    assert (sample["usage"], sample["hit_rate"], sample["hit_rate_kind"]) == (0.5, 0.125, "gauge")
    assert (sample["used_tokens"], sample["capacity_tokens"]) == (5000, 10000)


def test_measure_kv_errors_are_one_line():
    line = assert_one_line_error(tiderl("measure", "kv", "--engine", "http://127.0.0.1:1",
                                        "--duration", "0.5", "--interval", "0.5"), 1)
    assert "cannot read http://127.0.0.1:1/metrics" in line
    with FakeOtherMetricsServer() as fake:
        line = assert_one_line_error(tiderl("measure", "kv", "--engine", fake.url,
                                            "--duration", "0.5", "--interval", "0.5"), 1)
    assert "no KV-cache metrics found (expected tiderl:kv_cache_usage_perc" in line
    assert "sglang:cache_hit_rate" in line
    assert_one_line_error(tiderl("measure", "kv"), 2)
    assert_one_line_error(tiderl("measure", "kv", "--engine", "http://x", "--job", "j"), 2)
    assert_one_line_error(tiderl("measure", "kv", "--engine", "http://x", "--interval", "0"), 2)


# -- a real engine -------------------------------------------------------------------------------

def test_measure_kv_against_a_real_engine(tmp_path):
    model = tmp_path / "model"
    write_random_checkpoint("tiny", model)  # what `tiderl model init` writes
    port = free_port()
    args = ["engine", "serve", "--model", str(model), "--port", str(port),
            "--set", "engine.kv_cache_tokens=2048"]
    with serving(args, port, tmp_path / "server.log") as (url, _):
        profiler = subprocess.Popen(
            [*tiderl_command(), "measure", "kv", "--engine", url, "--duration", "3",
             "--interval", "0.5", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        try:
            note = profiler.stderr.readline()  # its baseline scrape is done: send traffic now
            assert note.startswith(f"sampling {url}/metrics (tiderl engine)"), note
            asyncio.run(_repeat_prompts(url, profiler))  # through every interval it samples
            out, err = profiler.communicate(timeout=60)
        finally:
            if profiler.poll() is None:
                profiler.kill()
                profiler.wait()
    assert profiler.returncode == 0, err
    data = json.loads(out)
    assert data["source"] == "tiderl engine"
    assert len(data["samples"]) == 6
    assert all(0.0 <= s["usage"] <= 1.0 for s in data["samples"])
    rates = [s["hit_rate"] for s in data["samples"] if s["hit_rate"] is not None]
    assert rates and max(rates) > 0.5  # the same 48-token prompt again: 3 full blocks hit


async def _repeat_prompts(url: str, profiler: subprocess.Popen) -> None:
    """The same prompt again and again while ``profiler`` runs (it samples for seconds)."""
    sampling = SamplingParams(max_tokens=2, temperature=0.0)
    deadline = time.monotonic() + HUNG_START_S
    async with TideRLHTTPClient(url) as client:
        k = 0
        while profiler.poll() is None:
            assert time.monotonic() < deadline, f"the profiler still runs after {HUNG_START_S} s"
            await client.generate(f"t{k}", list(range(10, 58)), sampling)
            k += 1


def test_measure_readiness_of_no_job_is_one_line(tmp_path):
    line = assert_one_line_error(tiderl("measure", "readiness", "--job", "nope", "--run-root",
                                        str(tmp_path)), 1)
    assert "no job 'nope'" in line


def test_measure_kv_of_a_job_that_is_gone_is_one_line(tmp_path):
    (tmp_path / "gone").mkdir()
    JobRecord("gone", str(tmp_path / "gone"), 0.0,
             info={"metrics": "http://127.0.0.1:1/metrics"}).save()
    line = assert_one_line_error(tiderl("measure", "kv", "--job", "gone", "--run-root",
                                        str(tmp_path), "--duration", "0.5", "--interval", "0.5"), 1)
    assert line.endswith("(is job gone still running?)")
