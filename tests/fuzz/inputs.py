"""Malformed-input fuzzers for the engine server and the environment service, and the runner that
sends them and counts the answers. Shared by ``tests/fuzz/`` and ``bench/robustness.py``.

    engine_cases(rng, n, ...) / env_cases(rng, n, ...) ──> [FuzzCase]  (seeded: random.Random)
    send_cases(url, cases) ──> FuzzCounts  (sent, 4xx, 5xx, dropped, bad error bodies, ...)
    engine_serves(url, token) / env_serves(url, token) ──> a correct request still answered?

Every case is malformed (``expect_4xx``) except those of the bounded floods, which may also be
answered 2xx; no case may get a 5xx, lose its connection, or a 4xx that is not the one-line
``{"error": {"message", "type"}}`` of both servers. The kinds: random bytes, wrong types, huge
values, out-of-vocabulary ids, enormous prompts and bodies, deep JSON nesting, wrong content
types, wrong methods and routes, missing or wrong tokens, bounded floods.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tiderl.env.protocol import MAX_BATCH_CALLS

JSON_TYPE = ("content-type", "application/json")
WRONG_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
               "application/octet-stream", "image/png")
HUGE_BODY_BYTES = 9 << 20  # over both servers' limits (8 MiB and 1 MiB)
MAX_FAILURES_KEPT = 20


@dataclass(frozen=True)
class FuzzCase:
    kind: str
    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = (JSON_TYPE,)
    expect_4xx: bool = True  # False: a flood request, which may also succeed


@dataclass
class FuzzCounts:
    sent: int = 0
    status_2xx: int = 0
    status_4xx: int = 0
    status_5xx: int = 0
    dropped: int = 0  # no answer: a transport error or a timeout
    bad_error_body: int = 0  # a 4xx whose body is not the one-line JSON error
    unexpected_success: int = 0  # a malformed case answered below 400
    correct_after: bool | None = None
    by_kind: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def is_clean(self) -> bool:
        return not (self.status_5xx or self.dropped or self.bad_error_body
                    or self.unexpected_success)

    def summary(self) -> dict:
        return {"sent": self.sent, "2xx": self.status_2xx, "4xx": self.status_4xx,
                "5xx": self.status_5xx, "dropped": self.dropped,
                "bad_error_body": self.bad_error_body,
                "unexpected_success": self.unexpected_success,
                "correct_after": self.correct_after, "by_kind": dict(sorted(self.by_kind.items())),
                "failures": self.failures[:MAX_FAILURES_KEPT]}


# -- building blocks -----------------------------------------------------------------------------

def _dumps(value: object) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def random_bytes(rng: random.Random, max_len: int = 600) -> bytes:
    body = rng.randbytes(rng.randrange(0, max_len))
    return body if not body.strip().startswith(b"{") else b"\x00" + body  # never a JSON object


def deep_nesting(rng: random.Random) -> bytes:
    depth = rng.choice([64, 1000, 10_000, 100_000, 400_000])
    opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    return opener * depth + b"1" + closer * depth


def _headers(token: str | None) -> tuple[tuple[str, str], ...]:
    return (JSON_TYPE, ("authorization", f"Bearer {token}")) if token else (JSON_TYPE,)


# -- the engine server ---------------------------------------------------------------------------

ENGINE_ADMIN_POSTS = ("/tiderl/pin", "/tiderl/unpin", "/tiderl/forget", "/tiderl/update_weights")


def engine_cases(rng: random.Random, n: int, *, vocab_size: int, max_model_len: int,
                 token: str | None) -> list[FuzzCase]:
    """``n`` malformed requests to ``tiderl engine serve`` (``token``: its admin token, used
    by the admin cases that test bodies; others go without one or with a wrong one)."""
    makers: list[tuple[int, Callable[[], FuzzCase]]] = [
        (12, lambda: FuzzCase("random_bytes", "POST", "/v1/completions", random_bytes(rng))),
        (20, lambda: _engine_wrong_type(rng)),
        (10, lambda: _engine_huge(rng)),
        (12, lambda: _engine_out_of_vocab(rng, vocab_size)),
        (6, lambda: _engine_enormous_prompt(rng, max_model_len)),
        (6, lambda: FuzzCase("deep_nesting", "POST", "/v1/completions", deep_nesting(rng))),
        (8, lambda: _wrong_content_type(rng, "/v1/completions", {"prompt": [1, 2, 3]})),
        (6, lambda: _wrong_route(rng, ("/v1/completions", "/health", "/metrics"))),
        (10, lambda: _engine_admin_no_token(rng)),
        (10, lambda: _engine_admin_bad_body(rng, token)),
    ]
    huge = b'{"prompt": [' + b"1, " * (HUGE_BODY_BYTES // 3) + b"1]}"  # over the size limit
    return [*_draw(rng, makers, n), FuzzCase("huge_body", "POST", "/v1/completions", huge)]


NAN = float("nan")
# values each field refuses (pydantic in lax mode takes "1", 1.0 and True for an int: none here)
ENGINE_WRONG: dict[str, list[object]] = {
    "prompt": ["hello", 1.5, {"a": 1}, None, True, [[1, 2]], [1.5], ["1"], [None], [True],
               [], [1, {"a": 2}]],
    "max_tokens": ["x", 1.5, None, [1], {"a": 1}, 0, -3],
    "temperature": ["hot", None, [1], {"a": 1}, -1.0, NAN, float("inf")],
    "top_p": ["x", None, 0.0, 2.0, NAN, -0.5],
    "seed": ["x", 1.5, [1], {"a": 1}],
    "logprobs": ["x", 1.5, [1]],
    "stop_token_ids": ["x", [1.5], ["a"], 5, [-1], [10 ** 6]],
    "task_id": [5, "", "t" * 300, [1], 1.5],
    "n": [2, 5, "x"],
    "stream": [True, "x", [1]],
    "model": [5, [1], {"a": 1}],
}


def _engine_wrong_type(rng: random.Random) -> FuzzCase:
    key = rng.choice(sorted(ENGINE_WRONG))
    body = {"prompt": [1, 2, 3], key: rng.choice(ENGINE_WRONG[key])}
    return FuzzCase("wrong_type", "POST", "/v1/completions", _dumps(body))


def _engine_huge(rng: random.Random) -> FuzzCase:
    field_, value = rng.choice([
        ("max_tokens", 10 ** 30), ("max_tokens", -(10 ** 30)), ("max_tokens", 0),
        ("temperature", -1e308), ("top_p", 1e308), ("top_p", 0.0), ("top_p", -5.0),
        ("stop_token_ids", [10 ** 20]), ("max_tokens", 10 ** 400)])
    return FuzzCase("huge_value", "POST", "/v1/completions",
                    _dumps({"prompt": [1, 2, 3], field_: value}))


def _engine_out_of_vocab(rng: random.Random, vocab_size: int) -> FuzzCase:
    prompt = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 30))]
    bad = rng.choice([vocab_size, vocab_size + rng.randrange(10 ** 6), -1,
                      -rng.randrange(1, 10 ** 9), 2 ** 63, -(2 ** 64)])
    prompt.insert(rng.randrange(len(prompt) + 1), bad)
    return FuzzCase("out_of_vocab", "POST", "/v1/completions", _dumps({"prompt": prompt}))


def _engine_enormous_prompt(rng: random.Random, max_model_len: int) -> FuzzCase:
    length = rng.choice([max_model_len, max_model_len + 1, 4 * max_model_len, 200_000])
    return FuzzCase("enormous_prompt", "POST", "/v1/completions",
                    _dumps({"prompt": [1] * length, "max_tokens": 1}))


def _engine_admin_no_token(rng: random.Random) -> FuzzCase:
    path = rng.choice([*ENGINE_ADMIN_POSTS, "/tiderl/flush", "/tiderl/sleep", "/tiderl/usage"])
    headers = rng.choice([(JSON_TYPE,), (JSON_TYPE, ("authorization", "Bearer wrong")),
                          (JSON_TYPE, ("authorization", "Basic dXNlcjpwYXNz")),
                          (JSON_TYPE, ("authorization", "Bearer"))])
    method = "GET" if path == "/tiderl/usage" else "POST"
    return FuzzCase("no_token", method, path, _dumps({"task_id": "t"}), headers)


def _engine_admin_bad_body(rng: random.Random, token: str | None) -> FuzzCase:
    path = rng.choice(ENGINE_ADMIN_POSTS)
    bad_task = [random_bytes(rng, 100), _dumps({}), _dumps({"task_id": rng.choice(
        [5, None, [1], "", 1.5])}), _dumps({"task_id": "t" * 300}), _dumps([1, 2]),
        deep_nesting(rng)]
    bad_weights = [_dumps({"path": "/no/such/folder", "version": 1}), _dumps({"version": 1}),
                   _dumps({"path": 5, "version": "x"}), _dumps({"path": "", "version": 1}),
                   _dumps({"path": "/tmp", "version": 1.5}), deep_nesting(rng)]
    body = rng.choice(bad_weights if path == "/tiderl/update_weights" else bad_task)
    return FuzzCase("admin_bad_body", "POST", path, body, _headers(token))


def engine_flood(n: int, token: str | None) -> list[FuzzCase]:
    """``n`` pins of distinct new tasks (their state is bounded: 409 past one per block)."""
    return [FuzzCase("flood_pin", "POST", "/tiderl/pin", _dumps({"task_id": f"flood-{i}"}),
                     _headers(token), expect_4xx=False) for i in range(n)]


# -- the environment service ---------------------------------------------------------------------

ENV_POSTS = ("/start", "/observation", "/end", "/pause", "/resume")
ENV_RAW_POSTS = (*ENV_POSTS, "/batch")  # a body no route reads: /batch refuses it whole too


def env_cases(rng: random.Random, n: int, *, token: str | None) -> list[FuzzCase]:
    """``n`` malformed requests to ``tiderl env serve`` (``token``: the service's)."""
    auth = _headers(token)
    makers: list[tuple[int, Callable[[], FuzzCase]]] = [
        (15, lambda: FuzzCase("random_bytes", "POST", rng.choice(ENV_RAW_POSTS),
                              random_bytes(rng), auth)),
        (8, lambda: _env_batch_wrong(rng, auth)),
        (20, lambda: _env_wrong_type(rng, auth)),
        (10, lambda: _env_huge(rng, auth)),
        (10, lambda: _env_unknown(rng, auth)),
        (6, lambda: FuzzCase("deep_nesting", "POST", rng.choice(ENV_RAW_POSTS),
                             deep_nesting(rng), auth)),
        (8, lambda: _wrong_content_type(rng, rng.choice(ENV_RAW_POSTS),
                                        {"env": 5, "session": 1}, token)),
        (6, lambda: _wrong_route(rng, ("/start", "/health", "/metrics"), token)),
        (10, lambda: FuzzCase("no_token", "POST", rng.choice(ENV_RAW_POSTS),
                              _dumps({"env": "guess"}),
                              rng.choice([(JSON_TYPE,),
                                          (JSON_TYPE, ("authorization", "Bearer nope"))]))),
    ]
    cases = _draw(rng, makers, n)
    cases.append(FuzzCase("huge_body", "POST", "/start",
                          b'{"env": "' + b"g" * HUGE_BODY_BYTES + b'"}', auth))
    return cases


ENV_BODIES: dict[str, dict[str, object]] = {  # a valid body per route, then made wrong
    "/start": {"env": "guess", "task": None, "seed": 0},
    "/observation": {"session": "s1", "action": "guess 1"},
    "/end": {"session": "s1"}, "/pause": {"session": "s1"}, "/resume": {"session": "s1"},
}
ENV_WRONG: dict[str, list[object]] = {  # msgspec is strict: no "7" for an int, no 1 for a str
    "env": [5, None, ["guess"], {"a": 1}, True],
    "task": [3, ["t"], {"a": 1}, 1.5],
    "seed": ["7", 1.5, None, [1], True],
    "session": [1, None, ["s1"], {"a": 1}, ""],
    "action": [1, None, ["guess"], {"a": 1}],
}


def _env_batch_wrong(rng: random.Random, auth: tuple) -> FuzzCase:
    """A /batch the server refuses whole (a call's own errors come back inside a 200 answer,
    one line per call: the server's tests pin those)."""
    start = {"call": "/start", "body": ENV_BODIES["/start"]}
    body = rng.choice([
        {"calls": []}, {"calls": "x"}, {"calls": [1]}, {}, {"calls": [start], "extra": 1},
        {"calls": [{"call": "/nope", "body": {}}]}, {"calls": [{"call": "/start"}]},
        {"calls": [{**start, "extra": 1}]}, {"calls": [start] * (MAX_BATCH_CALLS + 1)},
    ])
    return FuzzCase("batch_wrong", "POST", "/batch", _dumps(body), auth)


def _env_wrong_type(rng: random.Random, auth: tuple) -> FuzzCase:
    path = rng.choice(ENV_POSTS)
    body = dict(ENV_BODIES[path])
    choice = rng.randrange(3)
    if choice == 0:  # one field of a wrong type
        key = rng.choice(sorted(body))
        body[key] = rng.choice(ENV_WRONG[key])
    elif choice == 1:  # a required field missing
        del body[rng.choice([k for k in body if k not in ("task", "seed")])]
    else:  # a field the route does not have
        body[rng.choice(["extra", "Env", "sessions", "turn"])] = 1
    return FuzzCase("wrong_type", "POST", path, _dumps(body), auth)


def _env_huge(rng: random.Random, auth: tuple) -> FuzzCase:
    path, body = rng.choice([
        ("/start", {"env": "guess", "seed": 10 ** 30}),
        ("/start", {"env": "guess", "task": "t" * 5000}),
        ("/start", {"env": "g" * 100_000}),
        ("/observation", {"session": "s1", "action": "a" * rng.randrange(4097, 200_000)}),
        ("/end", {"session": "s" * 129}),
        ("/pause", {"session": "x" * 100_000})])
    return FuzzCase("huge_value", "POST", path, _dumps(body), auth)


def _env_unknown(rng: random.Random, auth: tuple) -> FuzzCase:
    """Names no server has: environments, sessions (the env's "out of vocabulary")."""
    if rng.random() < 0.4:
        name = rng.choice(["nope", "gym", "gym:Nope-v0", "os:system", "tiderl.env.base:Nope",
                           "../../etc/passwd", "", "GUESS"])
        return FuzzCase("unknown_name", "POST", "/start", _dumps({"env": name}), auth)
    session = rng.choice(["zz", f"s{rng.randrange(10 ** 9, 10 ** 10)}", "s-1", "\u00e9\u4e2d"])
    path = rng.choice(ENV_POSTS[1:])
    body = {"session": session, "action": "guess 1"} if path == "/observation" else {
        "session": session}
    return FuzzCase("unknown_name", "POST", path, _dumps(body), auth)


def env_flood(n: int, token: str | None) -> list[FuzzCase]:
    """``n`` starts: past the table's size they evict idle sessions (never a lock-out)."""
    return [FuzzCase("flood_start", "POST", "/start", _dumps({"env": "guess"}),
                     _headers(token), expect_4xx=False) for _ in range(n)]


# -- shared kinds --------------------------------------------------------------------------------

def _wrong_content_type(rng: random.Random, path: str, body: object,
                        token: str | None = None) -> FuzzCase:
    """A body that is malformed for the route, under a content type that is not JSON."""
    raw = rng.choice([_dumps(body), b"a=1&b=2", random_bytes(rng, 80)])
    headers = [("content-type", rng.choice(WRONG_TYPES))]
    if token:
        headers.append(("authorization", f"Bearer {token}"))
    return FuzzCase("wrong_content_type", "POST", path, raw, tuple(headers))


def _wrong_route(rng: random.Random, known: tuple[str, ...],
                 token: str | None = None) -> FuzzCase:
    if rng.random() < 0.5:
        path = rng.choice(["/", "/v2/completions", "/nope", "/start/", "/%00", "/health/x",
                           "/" + "a" * 2000])
        method = rng.choice(["GET", "POST"])
    else:
        path = rng.choice(known)
        method = rng.choice(["PUT", "DELETE", "PATCH"] + (["GET"] if path not in
                                                          ("/health", "/metrics") else []))
    return FuzzCase("wrong_route", method, path, b"", _headers(token))


def _draw(rng: random.Random, makers: list[tuple[int, Callable[[], FuzzCase]]],
          n: int) -> list[FuzzCase]:
    weights = [w for w, _ in makers]
    return [rng.choices(makers, weights)[0][1]() for _ in range(n)]


# -- sending -------------------------------------------------------------------------------------

def is_one_line_error(response: httpx.Response) -> bool:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    message = error.get("message") if isinstance(error, dict) else None
    return (isinstance(message, str) and bool(message) and "\n" not in message
            and isinstance(error.get("type"), str))


async def send_cases(url: str, cases: list[FuzzCase], counts: FuzzCounts | None = None, *,
                     concurrency: int = 8, timeout_s: float = 30.0) -> FuzzCounts:
    """Send every case (``concurrency`` at a time) and count the answers into ``counts``."""
    counts = counts or FuzzCounts()
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as http:
        async def one(case: FuzzCase) -> None:
            async with gate:
                await _send_one(http, case, counts)
        await asyncio.gather(*(one(case) for case in cases))
    return counts


async def _send_one(http: httpx.AsyncClient, case: FuzzCase, counts: FuzzCounts) -> None:
    counts.sent += 1
    counts.by_kind[case.kind] += 1
    where = f"{case.kind} {case.method} {case.path[:60]} {case.body[:60]!r}"
    try:
        response = await http.request(case.method, case.path, content=case.body,
                                      headers=dict(case.headers))
    except httpx.HTTPError as exc:
        counts.dropped += 1
        counts.failures.append(f"dropped ({type(exc).__name__}): {where}")
        return
    status = response.status_code
    if status >= 500:
        counts.status_5xx += 1
        counts.failures.append(f"{status} {response.text[:120]}: {where}")
    elif status >= 400:
        counts.status_4xx += 1
        if not is_one_line_error(response):
            counts.bad_error_body += 1
            counts.failures.append(f"{status} not a one-line JSON error "
                                   f"{response.text[:120]!r}: {where}")
    else:
        counts.status_2xx += 1
        if case.expect_4xx:
            counts.unexpected_success += 1
            counts.failures.append(f"{status} for a malformed request: {where}")


# -- correct requests afterwards -----------------------------------------------------------------

def engine_serves(url: str, token: str) -> bool:
    """A correct completion and correct admin calls, answered as they should be."""
    from tiderl.engine.clients import TideRLHTTPClient
    from tiderl.engine.request import SamplingParams

    async def check() -> bool:
        async with TideRLHTTPClient(url, timeout=60, admin_token=token) as client:
            out = await client.generate("check", [5, 6, 7, 8], SamplingParams(4, 0.0))
            usage = await client.token_usage()
            await client.forget("check")
            return len(out.output_ids) == 4 and usage.num_total_tokens > 0
    return asyncio.run(check())


def env_serves(url: str, token: str) -> bool:
    """A correct episode: start, the scripted solver's actions until done, end."""
    from tiderl.env.client import HTTPEnvClient
    from tiderl.env.guess import GuessEnv

    async def play() -> bool:
        async with HTTPEnvClient(url, token=token, retries=1) as client:
            started = await client.start("guess", "1 100", seed=5)
            solver = GuessEnv()
            solver.reset("1 100", 5)
            for _ in range(20):
                action = solver.solve()
                solver.step(action)
                out = await client.step(started.session, action)
                if out.done:
                    break
            await client.end(started.session)
            return out.done and out.reward == 1.0
    return asyncio.run(play())
