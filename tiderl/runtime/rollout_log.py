"""``rollouts/rank-N.jsonl`` (``logging.rollouts``): one line per episode a rank finished."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from tiderl.core.types import Trajectory
from tiderl.runtime.agent import AgentTask
from tiderl.runtime.log_backends import ROLLOUTS_DIR


class RolloutLog:
    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = run_dir / ROLLOUTS_DIR / f"rank-{rank}.jsonl"
        self._file: TextIO | None = None  # opened at the first episode

    def write(self, task: AgentTask, trajectory: Trajectory, transcript: list[dict]) -> None:
        """The episode's token ids per turn as trained (with its images and window cuts), and
        the turns played on this rank as the environment and the engine saw them (a task that
        moved here has those since its move only)."""
        if self._file is None:
            self.path.parent.mkdir(exist_ok=True)
            self._file = self.path.open("a", buffering=1)
        self._file.write(json.dumps({
            "task_id": task.task_id, "group_id": task.group_id, "env": task.env,
            "task": task.task, "seed": task.seed, "eval": task.eval,
            "reward": trajectory.reward,
            "turns": [{"context_ids": list(t.context_ids), "output_ids": list(t.output_ids),
                       "version": t.version, "restart": t.restart,
                       "images": [[i.key, i.offset, i.num_tokens] for i in t.images]}
                      for t in trajectory.turns],
            "transcript": transcript}) + "\n")
