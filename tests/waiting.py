"""Waiting, in tests, for a state the code under test announces with no event (a process gone
from /proc, a line in a log, a counter another thread bumps): the condition is polled, the wait
fails at once when a process it depends on has exited (``gone``), and it gives up only after a
deadline that a slow, loaded machine does not come near (that is a hang)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
HANG_S = 120.0


def wait_until(condition: Callable[[], T], what: str | Callable[[], str], *,
               gone: Callable[[], str | None] = lambda: None, timeout_s: float = HANG_S,
               interval_s: float = 0.05) -> T:
    """``condition()``'s first truthy value. ``gone()`` says why the wait is hopeless (None
    while it is not: the process that should bring the state about still runs); ``what``
    names the state in the failure (a callable: read when the wait fails)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        reason = gone()
        assert reason is None, f"not {_text(what)}: {reason}"
        assert time.monotonic() < deadline, f"not {_text(what)} within {timeout_s:.0f} s"
        time.sleep(interval_s)


def _text(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()
