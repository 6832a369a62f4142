"""What the coordinator keeps per GRPO group in flight, and its dataset (plain state, no policy).

Group ``i`` draws environment ``env.envs[i % len]`` with a seed derived from ``runtime.seed`` and
``i``; its G tasks share the seed (GRPO's shared prompt). Evaluation groups are numbered within
their phase and draw from another seed range.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiderl.core.commands import GroupSpec
from tiderl.core.segments import task_of
from tiderl.core.step_control import task_id
from tiderl.core.types import Group, SeqRef, Task, Trajectory
from tiderl.profile import Profile
from tiderl.trainer.sample import TrainSample


class CoordinatorError(RuntimeError):
    """The job cannot go on (a trainer rank died or failed); the message says which."""


@dataclass
class GroupRun:
    """A GRPO group in flight: its tasks' specs and, as they finish, their trajectories."""

    group_id: str
    tasks: dict[str, Task]
    task_text: str
    is_eval: bool
    step: int  # the step it was fed for (an evaluation phase's step)
    finished: dict[str, Trajectory] = field(default_factory=dict)
    samples: list[TrainSample] = field(default_factory=list)

    @property
    def is_complete(self) -> bool:
        return len(self.finished) == len(self.tasks)

    # the ReadyBuffer's view (core.buffer.ReadyGroup)
    @property
    def oldest_version(self) -> int:
        return min(s.version for s in self.samples)

    @property
    def sequences(self) -> tuple[SeqRef, ...]:
        return tuple(s.as_sequence() for s in self.samples)

    @property
    def num_samples(self) -> int:
        """GRPO samples: one per task, however many training sequences (segments, the
        screenshot window's cuts) its trajectory split into; as the simulator counts them."""
        return len({task_of(s.seq_id) for s in self.samples})


class Dataset:
    """The job's task stream, as the step controller asks for it (``group``)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    def group(self, spec: GroupSpec) -> Group:
        envs = self.profile.env.envs
        env = envs[spec.index % len(envs)]
        seed = (self.profile.runtime.seed * 1_000_003 + spec.index * 7919
                + (500_009 if spec.is_eval else 0))
        job = self.profile.job
        size = job.eval_size if spec.is_eval else job.group_size
        tasks = tuple(Task(task_id(spec.group_id, i), spec.group_id, env, spec.is_eval, None, seed)
                      for i in range(size))
        return Group(spec.group_id, tasks)

    def run(self, spec: GroupSpec) -> GroupRun:
        group = self.group(spec)
        env = group.tasks[0].env
        return GroupRun(spec.group_id, {t.task_id: t for t in group.tasks},
                        self.profile.env.tasks.get(env, ""), spec.is_eval, spec.step)
