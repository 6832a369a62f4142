"""SIGTERM as TideRL's long-running processes take it (the daemons, the launcher, ``top``)."""

from __future__ import annotations

import signal
import sys


def exit_on_sigterm(code: int = 143) -> None:
    """SIGTERM raises ``SystemExit(code)`` once, so that finally blocks run (a coordinator
    records how the job ended and writes its report); a second SIGTERM while they run is
    ignored, so it cannot cut that record short."""

    def handler(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(code)

    signal.signal(signal.SIGTERM, handler)
