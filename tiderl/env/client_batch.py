"""Calls made together travel together: how :class:`~tiderl.env.client.HTTPEnvClient` sends
the calls of many sessions in one request (``POST /batch``, :mod:`tiderl.env.server`).

    step() / start() / end() ...──submit(call, body)──> pending
        (once this turn of the event loop is over: every call submitted in it)
    flush ──POST /batch {calls} (at most MAX_BATCH_CALLS and BATCH_BYTES each)──> the service
    each answer line {index, status, body}, as it arrives ──> that call's future

A rank steps its sessions from many tasks of one event loop; the calls they make in the same
turn share one request, and each is answered as soon as its call is done (a batch never waits
for its slowest step). A future ends with an :class:`Answer`, with the ``httpx.TransportError``
that cut its batch off (an answer that ends early is a ``RemoteProtocolError``), or with
:class:`NotBatched` when the server has no /batch (an older or another implementation of the
protocol): then the caller sends the call alone, as every later one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import NamedTuple

import httpx
import msgspec

from tiderl.env.protocol import MAX_BATCH_CALLS, BatchAnswer

BATCH_BYTES = 512 * 1024  # under the server's body limit (1 MiB)
JSON_HEADERS = {"content-type": "application/json"}


class Answer(NamedTuple):
    """A call's answer: HTTP status, JSON body, ``Retry-After`` in seconds (or None)."""

    status: int
    content: bytes | msgspec.Raw
    retry_after_s: float | None


class NotBatched(Exception):
    """The server has no /batch: send the call alone."""


class Pending(NamedTuple):
    call: str
    body: bytes
    future: asyncio.Future[Answer]


class CallBatcher:
    """Collects the calls submitted in one turn of the event loop and posts them as batches
    through ``http``; ``is_supported`` turns False for good once the server has no /batch."""

    def __init__(self, http: httpx.AsyncClient, *, max_calls: int = MAX_BATCH_CALLS,
                 max_bytes: int = BATCH_BYTES) -> None:
        self.http = http
        self.max_calls = max_calls
        self.max_bytes = max_bytes
        self.is_supported = True
        self.pending: list[Pending] = []
        self.in_flight: set[asyncio.Task] = set()

    def submit(self, call: str, body: bytes) -> asyncio.Future[Answer]:
        loop = asyncio.get_running_loop()
        if not self.pending:
            loop.call_soon(self._flush)
        future: asyncio.Future[Answer] = loop.create_future()
        self.pending.append(Pending(call, body, future))
        return future

    async def close(self) -> None:
        """Stop the batches in flight (their calls fail as a dropped connection does)."""
        for task in list(self.in_flight):
            task.cancel()
        await asyncio.gather(*self.in_flight, return_exceptions=True)

    def _flush(self) -> None:
        pending, self.pending = self.pending, []
        for group in self._groups(pending):
            task = asyncio.ensure_future(self._post(group))
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)

    def _groups(self, pending: list[Pending]) -> Iterator[list[Pending]]:
        group: list[Pending] = []
        num_bytes = 0
        for item in pending:
            if group and (len(group) >= self.max_calls
                          or num_bytes + len(item.body) > self.max_bytes):
                yield group
                group, num_bytes = [], 0
            group.append(item)
            num_bytes += len(item.body) + 32
        if group:
            yield group

    async def _post(self, group: list[Pending]) -> None:
        futures = [item.future for item in group]
        body = b'{"calls":[%s]}' % b",".join(
            b'{"call":"%s","body":%s}' % (item.call.encode(), item.body) for item in group)
        try:
            async with self.http.stream("POST", "/batch", content=body,
                                        headers=JSON_HEADERS) as response:
                if response.status_code in (404, 405):  # no such route: nothing ran
                    self.is_supported = False
                    _fail(futures, NotBatched())
                elif response.status_code != 200:  # the batch refused whole (401, 413, 503)
                    await response.aread()
                    answer = Answer(response.status_code, response.content,
                                    parse_retry_after(response.headers.get("retry-after")))
                    for future in futures:
                        if not future.done():
                            future.set_result(answer)
                else:
                    await _read_answers(response, futures)
        except httpx.TransportError as exc:
            _fail(futures, exc)
        except (msgspec.MsgspecError, IndexError) as exc:
            _fail(futures, httpx.RemoteProtocolError(f"unexpected batch answer: {exc}"))
        except asyncio.CancelledError:
            _fail(futures, httpx.ReadError("the client was closed"))
            raise
        _fail(futures, httpx.RemoteProtocolError("the batch's answer ended before this call's"))


async def _read_answers(response: httpx.Response, futures: list[asyncio.Future]) -> None:
    """Resolve each call's future from its answer line, as lines arrive."""
    tail = b""
    async for chunk in response.aiter_bytes():
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        for line in lines:
            out = msgspec.json.decode(line, type=BatchAnswer)
            future = futures[out.index]
            if not future.done():  # its caller may have given up
                future.set_result(Answer(out.status, out.body, out.retry_after_s))


def _fail(futures: list[asyncio.Future], exc: BaseException) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(exc)


def parse_retry_after(value: str | None) -> float | None:
    """A `Retry-After` header in seconds (None: none, or not a number)."""
    try:
        return float(value) if value else None
    except ValueError:
        return None
