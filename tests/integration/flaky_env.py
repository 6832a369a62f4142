"""An environment whose every other reset fails with an unexpected error (a 500 from the
service): a real server answering 5xx now and then, for the client's retries."""

from __future__ import annotations

from tiderl.env.guess import GuessEnv

_RESETS = [0]  # per server process: resets so far


class FlakyGuessEnv(GuessEnv):
    name = "flaky"

    def reset(self, task: str | None, seed: int) -> tuple[str, dict]:
        _RESETS[0] += 1
        if _RESETS[0] % 2:
            raise RuntimeError(f"reset {_RESETS[0]} failed (on purpose)")
        return super().reset(task, seed)
