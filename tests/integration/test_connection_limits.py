"""The connection bounds of real `tiderl env serve` and `tiderl engine serve` processes
(tiderl/serving): a request slow to arrive is cut off (408, the connection closed) while others
are served, and one client address over its cap of open connections is refused (503) while
another address is served. Raw sockets play the slow clients; every wait is on the socket
closing or the server answering, never on a clock."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.serving import free_port, serving
from tests.waiting import HANG_S, wait_until

TIMEOUT_S = 0.5  # the header and body timeouts of the servers of the slow-client tests
OTHER_ADDRESS = "127.0.0.2"  # another client address on the loopback (Linux routes 127/8)


def server_args(kind: str, port: int, header_s: float, body_s: float,
                max_per_client: int) -> list[str]:
    """The command line of ``kind`` (env, engine) with these bounds: options of env serve,
    profile keys (``engine.connections``) of engine serve."""
    if kind == "env":
        return ["env", "serve", "--envs", "guess", "--port", str(port),
                "--header-timeout", str(header_s), "--body-timeout", str(body_s),
                "--max-client-connections", str(max_per_client)]
    return ["engine", "serve", "--port", str(port), "--set", "engine.kv_cache_tokens=256",
            "--set", f"engine.connections.header_timeout_s={header_s}",
            "--set", f"engine.connections.body_timeout_s={body_s}",
            "--set", f"engine.connections.max_per_client={max_per_client}"]


@contextlib.contextmanager
def bounded_server(kind: str, root: Path, header_s: float, body_s: float,
                   max_per_client: int = 256) -> Iterator[int]:
    """A ``kind`` server with these bounds, until the block ends; yields its port."""
    port = free_port()
    args = server_args(kind, port, header_s, body_s, max_per_client)
    with serving(args, port, root / f"{kind}.log"):
        yield port


@pytest.fixture(scope="module", params=["env", "engine"])
def slow_limits(request, tmp_path_factory):
    """A server of each kind with both timeouts at TIMEOUT_S: (kind, port)."""
    with bounded_server(request.param, tmp_path_factory.mktemp(request.param),
                        TIMEOUT_S, TIMEOUT_S) as port:
        yield request.param, port


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.settimeout(HANG_S)  # a recv that never returns fails the test instead of hanging it
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset ends it too)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {HANG_S:.0f} s: {data!r}")
    return data


def error_of(response: bytes, status: int) -> dict:
    """The one-line JSON error of a raw HTTP response with ``status`` and Connection: close."""
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].split(" ")[1] == str(status), response
    assert "connection: close" in [line.lower() for line in lines[1:]], response
    assert b"\n" not in body, response
    return json.loads(body)["error"]


def health_from(port: int, source: str = "127.0.0.1") -> int:
    """The status of one GET /health from ``source`` (0: the connection failed)."""
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=30) as http:
        try:
            return http.get(f"http://127.0.0.1:{port}/health").status_code
        except httpx.TransportError:
            return 0


def test_slow_loris_clients_are_cut_off_after_the_header_timeout_while_others_are_served(
        slow_limits):
    """One client sends a header line and stalls; others send a line every 0.1 s (the
    deadline is for the whole headers, not between bytes): each is answered 408 and
    disconnected, no sooner than the timeout, while a normal client is served."""
    _, port = slow_limits
    began = time.monotonic()
    stalled = connect(port)
    stalled.sendall(b"GET /health HTTP/1.1\r\n")
    tricklers = [connect(port) for _ in range(4)]
    stop = threading.Event()

    def trickle(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):  # the server closed it: done
            for i in range(100_000):
                sock.sendall(b"GET /health HTTP/1.1\r\n" if i == 0 else f"x-{i}: 1\r\n".encode())
                if stop.wait(0.1):
                    return
    threads = [threading.Thread(target=trickle, args=(sock,), daemon=True) for sock in tricklers]
    for thread in threads:
        thread.start()
    try:
        served = [health_from(port) for _ in range(3)]
        answer = read_until_closed(stalled)
        for sock in tricklers:
            read_until_closed(sock)
        elapsed = time.monotonic() - began
    finally:
        stop.set()
        for sock in [stalled, *tricklers]:
            sock.close()
    assert served == [200, 200, 200]
    error = error_of(answer, 408)
    assert error == {"message": f"request headers not complete within {TIMEOUT_S:g} s",
                     "type": "request_timeout"}
    assert elapsed >= TIMEOUT_S  # cut off by the deadline, not at once
    assert health_from(port) == 200


def test_a_stalled_body_is_cut_off_after_the_body_timeout(slow_limits):
    kind, port = slow_limits
    path = b"/start" if kind == "env" else b"/v1/completions"
    sock = connect(port)
    try:
        sent = time.monotonic()  # before sending: the server's deadline cannot start earlier
        sock.sendall(b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                     b"\r\ncontent-length: 100\r\n\r\n{\"prompt\": [1")
        answer = read_until_closed(sock)
        elapsed = time.monotonic() - sent
    finally:
        sock.close()
    error = error_of(answer, 408)
    assert error == {"message": f"request body not complete within {TIMEOUT_S:g} s",
                     "type": "request_timeout"}
    assert elapsed >= TIMEOUT_S
    assert health_from(port) == 200


@pytest.mark.parametrize("kind", ["env", "engine"])
def test_one_address_over_its_connection_cap_is_refused_while_another_is_served(kind, tmp_path):
    """Four connections from 127.0.0.1 held open (a long header timeout keeps them): a fifth
    is answered 503 and closed, another address is served, and a freed slot serves again."""
    cap = 4
    with bounded_server(kind, tmp_path, header_s=600, body_s=600,
                        max_per_client=cap) as port:
        held = [connect(port) for _ in range(cap)]
        try:
            extra = connect(port)
            extra.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            refused = read_until_closed(extra)
            extra.close()
            other = health_from(port, OTHER_ADDRESS)
            held.pop().close()
            wait_until(lambda: health_from(port) == 200, "a freed slot served again")
        finally:
            for sock in held:
                sock.close()
    error = error_of(refused, 503)
    assert b"\r\nretry-after: 1\r\n" in refused.lower()
    assert error == {"message": f"too many connections from 127.0.0.1: the server holds {cap} "
                                "open per client address; close one and retry",
                     "type": "too_many_connections"}
    assert other == 200
