"""The coordinator's step controller, and a replay's side of it (``runtime.replay``).

    runtime.replay unset ──> StepController (rollout, ERS, RA2P: the job's own steps)
    runtime.replay set ──> ReplayController (tiderl.core.step_control.replay), whose ``load``
        is :func:`recorded_step`: batches/step-N.msgpack read and checked against this job's
        shape, its samples and rewards filed in the GroupStore (the Dispatches name them, and
        StepLink sends them as it sends rolled-out ones), the core's view of it returned

A recording that does not fit stops the job with its one line (``tiderl launch`` checks step 0
and the step count before anything starts; each step is checked again as it loads).
"""

from __future__ import annotations

from pathlib import Path

from tiderl.core.commands import StartStep
from tiderl.core.segments import task_of
from tiderl.core.step_control import StepController
from tiderl.core.step_control.replay import ReplayController, ReplayStep
from tiderl.core.types import MicroBatch, Role
from tiderl.profile import Profile
from tiderl.runtime.errors import CoordinatorError
from tiderl.runtime.groups import GroupStore
from tiderl.runtime.recording import (
    RecordedShape,
    RecordingError,
    check_step,
    read_step,
    replay_folder,
    shape_of,
)
from tiderl.runtime.step_config import profile_step_config
from tiderl.runtime.trajectory_wire import sample_of


def step_controller(profile: Profile, roles: list[Role], store: GroupStore,
                    now: float) -> StepController:
    """The controller the coordinator drives: a replay's when ``runtime.replay`` names a
    recording."""
    config = profile_step_config(profile)
    if not profile.runtime.replay:
        return StepController(config, roles, store.dataset.group, now=now)
    folder, shape = replay_folder(profile.runtime.replay), shape_of(profile)
    return ReplayController(config, roles, store.dataset.group,
                            lambda step: recorded_step(folder, step, shape, store), now=now)


def recorded_step(folder: Path, step: int, shape: RecordedShape,
                  store: GroupStore) -> ReplayStep:
    """Recorded step ``step``, its samples and rewards in ``store`` (CoordinatorError, one
    line, when it cannot be read or is of another shape)."""
    try:
        batches = check_step(read_step(folder, step), shape, folder)
    except RecordingError as exc:
        raise CoordinatorError(f"runtime.replay: {exc}") from None
    micro_batches, group_ids, tasks = [], set(), set()
    for index, recorded in enumerate(batches.micro_batches):
        refs = []
        for data, reward in zip(recorded.samples, recorded.rewards, strict=True):
            sample = sample_of(data)
            store.samples[sample.seq_id], store.rewards[sample.seq_id] = sample, reward
            refs.append(sample.as_sequence())
            tasks.add(task_of(sample.seq_id))
            group_ids.add(task_of(sample.seq_id).rpartition(".")[0])
        micro_batches.append(MicroBatch(index, tuple(refs)))
    start = batches.start
    return ReplayStep(StartStep(step, start.step_mode, tuple(start.ref_ranks),
                                tuple(start.actor_ranks), start.max_aggregate),
                      tuple(micro_batches), frozenset(group_ids), len(tasks), batches.loss)
