"""The job's data as the coordinator holds it: its dataset, the GRPO groups in flight, and the
samples of the groups that are ready until they train or are dropped (plain state, no policy).

    FeedGroups ──Dataset.run──> GroupRun in flight ──TaskFinished (each task's trajectory)──>
        complete: evaluation (its rewards; the phase's mean once its last group is back) |
        failed (a task played no turn: it cannot train) | ready (group-standardised
        advantages; its samples by sequence id, with their rewards, until a step takes them)

Group ``i`` draws environment ``env.envs[i % len]`` with a seed derived from ``runtime.seed`` and
``i``; its tasks share the seed (GRPO's shared prompt). Evaluation groups are numbered within
their phase and draw from another seed range.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tiderl.core.commands import DropReason, GroupDropped, GroupSpec
from tiderl.core.grpo import group_advantages
from tiderl.core.segments import task_of
from tiderl.core.step_control import task_id
from tiderl.core.types import Group, SeqRef, Task, Trajectory
from tiderl.profile import Profile
from tiderl.runtime import bus as b
from tiderl.runtime.errors import CoordinatorError
from tiderl.runtime.resume import ReadyGroupState
from tiderl.runtime.trajectory_wire import sample_data, sample_of, turn_of
from tiderl.trainer.sample import TrainSample

# A job whose tasks all fail (an environment or a model that cannot play them) stops with the
# reason after this many groups, instead of feeding new ones for ever.
MAX_FAILED_GROUPS_IN_A_ROW = 32


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
        max_turns = self.profile.env.max_turns  # the rollout rank's agent loop stops there
        tasks = tuple(Task(task_id(spec.group_id, i), spec.group_id, env, spec.is_eval, None, seed,
                           max_turns) for i in range(size))
        return Group(spec.group_id, tasks)

    def run(self, spec: GroupSpec) -> GroupRun:
        group = self.group(spec)
        env = group.tasks[0].env
        return GroupRun(spec.group_id, {t.task_id: t for t in group.tasks},
                        self.profile.env.tasks.get(env, ""), spec.is_eval, spec.step)


class GroupStore:
    """The groups in flight, the ready groups' samples and rewards, and the evaluations'."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.dataset = Dataset(profile)
        self.in_flight: dict[str, GroupRun] = {}
        self.samples: dict[str, TrainSample] = {}  # ready, not yet dispatched, by seq id
        self.rewards: dict[str, float] = {}
        self.eval_rewards: dict[int, list[float]] = {}  # by step, as the phase's groups end
        self.eval_done: dict[int, float] = {}  # the phase's mean, once its last group ended
        self.failed_in_a_row = 0  # training groups with a failed task since the last good one
        self.last_task_error = ""  # the last task failure a rank reported, for the job's end

    def feed(self, spec: GroupSpec) -> GroupRun:
        run = self.dataset.run(spec)
        self.in_flight[spec.group_id] = run
        if spec.is_eval:
            self.eval_rewards.setdefault(spec.step, [])
        return run

    def finished(self, msg: b.TaskFinished) -> GroupRun | None:
        """A task's trajectory; its group, now out of flight, when that completed it."""
        group = self.in_flight[msg.group_id]
        if msg.error:
            self.last_task_error = f"task {msg.task_id} on rank {msg.rank}: {msg.error}"
        group.finished[msg.task_id] = Trajectory(msg.task_id, msg.group_id,
                                                 [turn_of(t) for t in msg.turns], msg.reward,
                                                 dict(msg.image_data))
        if not group.is_complete:
            return None
        del self.in_flight[group.group_id]
        return group

    def is_in_flight(self, group_id: str, task_id: str) -> bool:
        group = self.in_flight.get(group_id)
        return group is not None and task_id in group.tasks

    def complete(self, group: GroupRun) -> GroupRun | None:
        """A group every task of which finished: the group to train (its samples kept here),
        or None (an evaluation group, or one with a task that played no turn)."""
        trajectories = [group.finished[task] for task in group.tasks]  # in task order
        rewards = [t.reward or 0.0 for t in trajectories]
        if group.is_eval:
            self.eval_rewards.setdefault(group.step, []).extend(rewards)
            return None
        if any(not t.turns for t in trajectories):
            self.failed_in_a_row += 1
            if self.failed_in_a_row >= MAX_FAILED_GROUPS_IN_A_ROW:
                raise CoordinatorError(
                    f"{self.failed_in_a_row} groups in a row had a task that failed, so "
                    f"nothing can train; the last: {self.last_task_error or 'no turn played'}")
            return None
        self.failed_in_a_row = 0
        advantages = group_advantages(rewards, self.profile.trainer.adv_eps)
        for trajectory, advantage, reward in zip(trajectories, advantages, rewards, strict=True):
            for sample in TrainSample.from_trajectory(trajectory, advantage,
                                                      trajectory.image_data):
                group.samples.append(sample)
                self.samples[sample.seq_id] = sample
                self.rewards[sample.seq_id] = reward
        return group

    def evaluation_ended(self, step: int) -> bool:
        """Whether the evaluation of ``step`` has no group in flight any more (its mean is
        then in ``eval_done``)."""
        if any(g.is_eval and g.step == step for g in self.in_flight.values()):
            return False
        scores = self.eval_rewards[step]
        self.eval_done[step] = sum(scores) / len(scores)
        return True

    def seqs_of(self, group_id: str) -> list[str]:
        """The ready training sequences of a group's tasks (a task's segments included), in
        task order."""
        tasks = {task_id(group_id, i) for i in range(self.profile.job.group_size)}
        return [seq for seq in self.samples if task_of(seq) in tasks]

    def drop(self, command: GroupDropped, event: Callable[..., None]) -> None:
        """A group left the buffer untrained: its samples go, and a ``dropped_group`` event
        says why (a stale one, how stale)."""
        for seq in self.seqs_of(command.group_id):
            self.samples.pop(seq, None)
            self.rewards.pop(seq, None)
        fields = {"oldest_version": command.oldest_version, "batch": command.batch} \
            if command.reason is DropReason.STALE else {}
        event("dropped_group", group=command.group_id, reason=command.reason.value, **fields)

    def ready_state(self, group_ids: tuple[str, ...]) -> list[ReadyGroupState]:
        """The ready groups of a checkpoint, with their samples and rewards."""
        out = []
        for group_id in group_ids:
            ids = self.seqs_of(group_id)
            out.append(ReadyGroupState(group_id, int(group_id[1:]), 0,
                                       [sample_data(self.samples[i]) for i in ids],
                                       [self.rewards[i] for i in ids]))
        return out

    def restore(self, ready: list[ReadyGroupState]) -> list[GroupRun]:
        """A checkpoint's ready groups, with their samples, back in the store."""
        runs = []
        for state in ready:
            run = self.dataset.run(GroupSpec(state.group_id, state.index, False, state.step))
            run.samples = [sample_of(d) for d in state.samples]
            for sample, reward in zip(run.samples, state.rewards, strict=True):
                self.samples[sample.seq_id] = sample
                self.rewards[sample.seq_id] = reward
            runs.append(run)
        return runs
