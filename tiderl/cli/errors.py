"""Errors the CLI turns into one line on stderr and an exit code (2: bad usage or profile,
1: a runtime failure or a command that is not built yet)."""

from __future__ import annotations

EXIT_FAILURE = 1
EXIT_USAGE = 2


class CLIError(Exception):
    def __init__(self, message: str, exit_code: int = EXIT_FAILURE):
        super().__init__(message)
        self.exit_code = exit_code


def not_built(command: str) -> CLIError:
    """The error a command that does not exist yet raises: it never fakes output."""
    return CLIError(f"tiderl {command}: not built yet", EXIT_FAILURE)
