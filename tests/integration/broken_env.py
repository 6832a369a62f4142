"""An environment that cannot start an episode: every reset fails (a one-line 4xx from the
service), so every task of a job on it fails."""

from __future__ import annotations

from tiderl.env.guess import GuessEnv


class OffScreen(GuessEnv):
    name = "off"

    def reset(self, task: str | None, seed: int) -> tuple[str, dict]:
        raise ValueError("the screen is off (on purpose)")
