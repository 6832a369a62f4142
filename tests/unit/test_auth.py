"""Where the HTTP services' tokens come from, and how a bearer header is checked."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from tiderl.auth import (
    ADMIN,
    ENV,
    ServiceGuard,
    TokenError,
    bearer_headers,
    is_authorized,
    job_token,
    resolve_token,
)


def keys_folder(tmp_path, secret: bytes = b"ab" * 32):
    folder = tmp_path / "keys"
    folder.mkdir(mode=0o700, parents=True)
    fd = os.open(folder / "http.secret", os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, secret + b"\n")
    os.close(fd)
    return folder


def test_the_explicit_token_then_its_variable_then_the_jobs(tmp_path):
    folder = keys_folder(tmp_path)
    job = {"TIDERL_JOB_KEYS": str(folder)}
    assert resolve_token(ADMIN, "given", job) == "given"
    assert resolve_token(ADMIN, None, {**job, "TIDERL_ADMIN_TOKEN": "var"}) == "var"
    assert resolve_token(ENV, None, {**job, "TIDERL_ADMIN_TOKEN": "var"}) == job_token(folder,
                                                                                       ENV)
    assert resolve_token(ADMIN, None, {}) is None  # no token: the server's fallback rule


def test_a_jobs_tokens_differ_by_purpose_and_by_job(tmp_path):
    one = keys_folder(tmp_path / "1")
    other = keys_folder(tmp_path / "2", b"cd" * 32)
    admin, env = job_token(one, ADMIN), job_token(one, ENV)
    assert len(admin) == len(env) == 64 and admin != env
    assert job_token(one, ADMIN) == admin  # deterministic: every process of the job agrees
    assert job_token(other, ADMIN) != admin
    assert "abab" not in admin  # the secret itself never goes over HTTP


def test_a_missing_secret_is_one_clear_error(tmp_path):
    with pytest.raises(TokenError, match=r"http\.secret: cannot read the job's HTTP secret"):
        job_token(tmp_path, ADMIN)


def test_bearer_headers_and_their_check():
    assert bearer_headers(None) == {} and bearer_headers("t") == {"Authorization": "Bearer t"}
    assert is_authorized("Bearer t", "t") and is_authorized("bearer  t ", "t")
    for header in (None, "", "Bearer", "Bearer u", "Basic t", "t"):
        assert not is_authorized(header, "t"), header


def guarded(token, *, loopback_without_token=True, limit=16):
    """A ServiceGuard in front of an app that answers 200 with the body it was handed."""
    async def app(scope, receive, send):
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})
    return ServiceGuard(app, token=token, is_protected=lambda path: path.startswith("/admin"),
                        max_body_bytes=limit, loopback_without_token=loopback_without_token)


def call(guard, path, *, client="127.0.0.1", headers=(), chunks=(b"{}",)):
    """One HTTP request through ``guard`` as uvicorn hands it over (the body in ``chunks``)."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "client": (client, 5555),
             "headers": [(k.encode(), v.encode()) for k, v in headers]}
    asyncio.run(guard(scope, receive, send))
    status, body = sent[0]["status"], sent[1]["body"]
    return status, (json.loads(body)["error"] if status >= 400 else body), messages


def test_without_a_token_admin_routes_answer_loopback_clients_only():
    guard = guarded(None)
    assert call(guard, "/admin/pin")[:2] == (200, b"{}")
    assert call(guard, "/admin/pin", client="::1")[0] == 200
    status, error, _ = call(guard, "/admin/pin", client="10.0.0.5")
    assert status == 403 and error["type"] == "forbidden" and "loopback" in error["message"]
    assert call(guard, "/v1/completions", client="10.0.0.5")[0] == 200  # not protected
    assert call(guarded(None, loopback_without_token=False), "/admin/pin",
                client="10.0.0.5")[0] == 200  # the environment service: open without one


def test_a_token_guards_protected_routes_whatever_the_client():
    guard = guarded("t")
    assert call(guard, "/admin/pin", headers=[("authorization", "Bearer t")])[0] == 200
    status, error, left = call(guard, "/admin/pin", chunks=(b"{", b"}"))
    assert (status, error["type"], left) == (401, "unauthorized", [])  # body read to its end
    assert call(guard, "/admin/pin", headers=[("authorization", "Bearer u")])[0] == 401
    assert call(guard, "/open")[0] == 200


def test_a_body_over_the_limit_is_413_read_to_its_end_and_never_handed_on():
    status, error, left = call(guarded(None), "/open", chunks=(b"x" * 10, b"y" * 10))
    assert (status, error["type"], left) == (413, "body_too_large", [])
    assert call(guarded(None), "/open", chunks=(b"x" * 8, b"y" * 8))[1] == b"x" * 8 + b"y" * 8
