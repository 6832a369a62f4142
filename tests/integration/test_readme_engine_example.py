"""The README's engine example as a user types it: `model init`, `engine serve`, then the curl
request's body (read from README.md) gets the ids and their logprobs back."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx

from tests.integration.serving import free_port, serving, tiderl_command

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_request() -> dict:
    """The JSON body of the README's curl against /v1/completions."""
    match = re.search(r"curl -s localhost:8000/v1/completions .*?-d '(\{.*?\})'",
                      README.read_text(), re.S)
    assert match, "README.md has no curl example against /v1/completions"
    return json.loads(match.group(1))


def test_the_readme_curl_gets_token_ids_and_their_logprobs(tmp_path):
    body = readme_request()
    model = tmp_path / "tiny"
    init = subprocess.run([*tiderl_command(), "model", "init", "--size", "tiny", "--out",
                           str(model)], capture_output=True, text=True, timeout=300)
    assert init.returncode == 0, init.stderr
    port = free_port()
    args = ["engine", "serve", "--model", str(model), "--port", str(port),
            "--set", "engine.kv_cache_tokens=4096"]
    with serving(args, port, tmp_path / "server.log") as (url, _):
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    assert len(choice["token_ids"]) == body["max_tokens"]
    logprobs = choice["logprobs"]["token_logprobs"]  # not null: the request asks for them
    assert len(logprobs) == len(choice["token_ids"]) and all(lp <= 0 for lp in logprobs)
