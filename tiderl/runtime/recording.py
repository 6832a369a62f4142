"""``batches/step-N.msgpack`` (``logging.batches``): what crossed the rollout/train boundary in
each step, as the trainer ranks got it; read back by a replay (``runtime.replay``).

    StepLink   StartStep ──TrainStep──>        (the start: step mode, ranks, max_aggregate,
                                                attempt)
               Dispatch ──MicroBatchData──>    (the samples as the bus carries them, with their
                                                rewards, in dispatch order)
               every rank's StepDone ──> the step trained ──BatchTape.record──>
                   batches/step-00000003.msgpack (write, fsync, rename)

One msgpack document per step, typed with msgspec like the bus and a checkpoint's job state
(:class:`StepBatches`): ``shape`` is the recording job's (what a replay must share with it);
``start`` the attempt that trained (an attempt a trainer rank died in is not kept);
``micro_batches`` its samples (``TrainSampleData``: ids, loss mask, behaviour logprobs,
advantage, version) and rewards; then whether it trained (a roll-out-only job's steps did not)
and the ranks' ``StepDone`` figures, with the step's loss as metrics.jsonl has it (the mean
over its actors), unrounded.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import msgspec

from tiderl.core import commands as c
from tiderl.core.system import StepMode
from tiderl.profile import Profile
from tiderl.runtime import bus as b
from tiderl.runtime.resume import write_atomic

BATCHES = "batches"  # the folder in a run folder
SCHEMA = 1
STEP_FILE = re.compile(r"step-(\d{8})\.msgpack")


class RecordingError(ValueError):
    """A recording that cannot be read, or not replayed by this job; one line."""


class RecordedShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a replay must share with the job that recorded the steps."""

    system: str
    num_ranks: int
    group_size: int
    trainer_backend: str
    tensor_parallel: int
    model: str  # its weights: a folder, or a random-init size and seed; and the dtype


class RecordedStart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    step_mode: StepMode
    ref_ranks: list[int]
    actor_ranks: list[int]
    max_aggregate: int
    attempt: int


class RecordedMicroBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    samples: list[b.TrainSampleData]
    rewards: list[float]  # each sample's episode reward


class RecordedRank(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A trainer rank's StepDone (a Ref rank reports no loss of its own)."""

    rank: int
    loss: float | None
    loss_tokens: int | None
    grad_norm: float | None


class StepBatches(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    schema: int
    shape: RecordedShape
    step: int
    start: RecordedStart
    micro_batches: list[RecordedMicroBatch]
    is_trained: bool  # false: runtime.train was false, no optimizer step ran
    loss: float | None
    loss_tokens: int | None
    ranks: list[RecordedRank]


# (field of RecordedShape, the profile key a replay must match it with)
SHAPE_KEYS = (("system", "runtime.system"), ("num_ranks", "runtime.num_ranks"),
              ("group_size", "job.group_size"), ("trainer_backend", "trainer.backend"),
              ("tensor_parallel", "trainer.tensor_parallel"), ("model", "model"))


def shape_of(profile: Profile) -> RecordedShape:
    model = profile.model
    weights = str(Path(model.path).resolve()) if model.path else \
        f"random-init {model.size} seed {model.seed}"
    return RecordedShape(profile.runtime.system, profile.runtime.num_ranks,
                         profile.job.group_size, profile.trainer.backend,
                         profile.trainer.tensor_parallel, f"{weights} {model.dtype}")


def shape_problem(recorded: RecordedShape, here: RecordedShape) -> str | None:
    """Why a job of shape ``here`` cannot replay steps recorded at ``recorded``; None if it can."""
    for name, key in SHAPE_KEYS:
        was, now = getattr(recorded, name), getattr(here, name)
        if was != now:
            return f"recorded with {key} {was}, this job has {now}"
    return None


def step_file(folder: Path, step: int) -> Path:
    return folder / f"step-{step:08d}.msgpack"


class BatchTape:
    """A job's recording: each step to its file once it trained (or, with ``runtime.train``
    false, once its batch was complete)."""

    def __init__(self, folder: Path, shape: RecordedShape) -> None:
        self.folder, self.shape = folder, shape

    def record(self, start: c.StartStep, sent: Sequence[b.MicroBatchData],
               rewards: Sequence[float], reports: Sequence[c.RankReport],
               is_trained: bool) -> Path:
        """Step ``start``: ``sent``, its micro-batches in dispatch order, and ``rewards``, their
        samples' in the same order; ``reports``, its ranks'."""
        micro_batches, offset = [], 0
        for mb in sent:
            count = len(mb.samples)
            micro_batches.append(RecordedMicroBatch(mb.samples,
                                                    list(rewards[offset:offset + count])))
            offset += count
        loss, _, loss_tokens = c.StepOutcome(start.step, tuple(reports)).actor_figures(
            start.actor_ranks)
        batches = StepBatches(
            SCHEMA, self.shape, start.step,
            RecordedStart(start.step_mode, list(start.ref_ranks), list(start.actor_ranks),
                          start.max_aggregate, start.attempt),
            micro_batches, is_trained, loss, loss_tokens,
            [RecordedRank(r.rank, r.loss, r.loss_tokens, r.grad_norm)
             for r in sorted(reports, key=lambda r: r.rank)])
        self.folder.mkdir(exist_ok=True)
        path = step_file(self.folder, start.step)
        write_atomic(path, msgspec.msgpack.encode(batches))
        return path


def batch_tape(profile: Profile, run_dir: Path) -> BatchTape | None:
    """The job's recording with ``logging.batches``; None without."""
    return BatchTape(run_dir / BATCHES, shape_of(profile)) if profile.logging.batches else None


# --------------------------------------------------------------------------- reading it back


def replay_folder(path: str | Path) -> Path:
    """The batches folder ``runtime.replay`` names: the folder itself, or a run folder's."""
    folder = Path(path)
    return folder / BATCHES if (folder / BATCHES).is_dir() else folder


def recorded_steps(folder: Path) -> list[int]:
    """The steps ``folder`` holds a file of, in order."""
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := STEP_FILE.fullmatch(p.name)))


def read_step(folder: Path, step: int) -> StepBatches:
    """Step ``step`` of the recording in ``folder``; RecordingError (one line) if it has none,
    or what it has is not a step of this format."""
    path = step_file(folder, step)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RecordingError(f"{folder} has no recorded step {step} ({_holds(folder)})") from None
    except OSError as exc:
        raise RecordingError(f"{path}: {exc.strerror or exc}") from None
    try:
        batches = msgspec.msgpack.decode(data, type=StepBatches)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        why = " ".join(str(exc).split())
        raise RecordingError(f"{path} is not a batch recording of this TideRL ({why})") from None
    if batches.schema != SCHEMA or batches.step != step:
        raise RecordingError(f"{path} holds step {batches.step} of schema {batches.schema}, "
                             f"not step {step} of schema {SCHEMA}")
    return batches


def check_step(batches: StepBatches, here: RecordedShape, folder: Path) -> StepBatches:
    """``batches`` if a job of shape ``here`` can replay it; RecordingError otherwise."""
    problem = shape_problem(batches.shape, here)
    if problem is not None:
        raise RecordingError(f"{folder} step {batches.step} was {problem}")
    return batches


def check_recording(profile: Profile) -> Path:
    """The batches folder of ``runtime.replay`` if it holds the steps this job trains, of its
    shape (step 0's is checked here; the coordinator checks each step as it loads it);
    RecordingError naming what does not fit otherwise."""
    folder = replay_folder(profile.runtime.replay)
    if not folder.is_dir():
        raise RecordingError(f"{folder} is not a folder (a run folder's {BATCHES}/, written "
                             "with logging.batches=true)")
    steps = profile.job.steps
    missing = sorted(set(range(steps)) - set(recorded_steps(folder)))
    if missing:
        raise RecordingError(f"{folder} has no recorded step {missing[0]} of the {steps} this "
                             f"job trains ({_holds(folder)}; job.steps sets how many)")
    check_step(read_step(folder, 0), shape_of(profile), folder)
    return folder


def _holds(folder: Path) -> str:
    steps = recorded_steps(folder)
    if len(steps) < 2:
        return f"it holds step {steps[0]}" if steps else "it holds none"
    if steps[-1] - steps[0] + 1 == len(steps):
        return f"it holds steps {steps[0]}-{steps[-1]}"
    return f"it holds steps {', '.join(map(str, steps))}"
