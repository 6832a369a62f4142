"""Experiment-tracking backends: each step's record, beside its metrics.jsonl line, as TensorBoard
scalars and as a wandb run (``logging.backends`` of the profile, :class:`LoggingConfig`).

    RunLog.record ──> metrics.jsonl (always)
                 └──> StepWriter.write(step, numbers) for each listed backend:
                        tensorboard  <run_dir>/tensorboard/events.out.tfevents.*
                        wandb        <run_dir>/wandb/offline-run-*/run-*.wandb (offline by default)

A writer gets the record's numbers (its strings and lists, ``mode``, ``ers_reason`` and
``roles``, stay in metrics.jsonl), keyed as in metrics.jsonl, at the record's step. Events stay
in events.jsonl. Each library is imported when its backend is listed, and only then (wandb's
import alone takes about 0.3 s); :func:`missing_backends` finds one that is not installed without
importing it, so that ``tiderl launch`` can say so before any process starts.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from tiderl.profile.sections import LoggingConfig

log = logging.getLogger("tiderl.coordinator")

EXTRA = "tiderl[logging]"  # the pip extra that installs both libraries
MODULES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # backend -> the module it imports
TENSORBOARD_DIR = "tensorboard"  # in the run folder; wandb makes its own "wandb" folder there
WANDB_DIR = "wandb"
ROLLOUTS_DIR = "rollouts"  # logging.rollouts: rank-N.jsonl, written by each rank on its node


class LoggingBackendError(Exception):
    """A listed backend that cannot write; the message is one line naming the key."""


class StepWriter(Protocol):
    def write(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def missing_backends(backends: list[str]) -> list[str]:
    """The listed backends whose library this python cannot import."""
    return [name for name in backends
            if name in MODULES and importlib.util.find_spec(MODULES[name]) is None]


def missing_line(missing: list[str]) -> str:
    verb = "is" if len(missing) == 1 else "are"
    return (f"logging.backends: {', '.join(missing)} {verb} listed but not installed "
            f"(pip install '{EXTRA}')")


def open_writers(config: LoggingConfig, run_dir: Path,
                 run_config: dict[str, Any]) -> list[StepWriter]:
    """A writer per listed backend other than jsonl (RunLog writes that one itself);
    ``run_config`` is the resolved profile, which wandb keeps as the run's config."""
    missing = missing_backends(config.backends)
    if missing:
        raise LoggingBackendError(missing_line(missing))
    writers: list[StepWriter] = []
    for name in (n for n in config.backends if n in MODULES):
        start = time.monotonic()
        try:
            writers.append(_open(name, config, Path(run_dir), run_config))
        except LoggingBackendError:
            for writer in writers:
                writer.close()
            raise
        log.info("logging backend %s open in %.2f s", name, time.monotonic() - start)
    return writers


def _open(name: str, config: LoggingConfig, run_dir: Path,
          run_config: dict[str, Any]) -> StepWriter:
    if name == "tensorboard":
        return TensorBoardWriter(run_dir / TENSORBOARD_DIR)
    return WandbWriter(run_dir, config, run_config)


class TensorBoardWriter:
    """Scalars into an event file of ``logdir`` (a new file each time the coordinator starts),
    with the ``tensorboard`` package's own writer: no torch in the coordinator."""

    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._writer = EventFileWriter(str(logdir))
        self._is_first = True

    def write(self, step: int, values: dict[str, float]) -> None:
        pb, now = self._event_pb2, time.time()
        if self._is_first:  # a resumed job trains its steps from here again: TensorBoard drops
            self._is_first = False  # the points of an earlier file at this step and after
            start = pb.SessionLog(status=pb.SessionLog.START)
            self._writer.add_event(pb.Event(step=step, wall_time=now, session_log=start))
        Value = self._summary_pb2.Summary.Value
        summary = self._summary_pb2.Summary(
            value=[Value(tag=tag, simple_value=value) for tag, value in values.items()])
        self._writer.add_event(pb.Event(step=step, wall_time=now, summary=summary))
        self._writer.flush()  # as metrics.jsonl: a step on disk once it is recorded

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """A wandb run in ``<run_dir>/wandb/``, named after the job, the profile as its config.
    Offline (``logging.wandb_mode``) it makes no network call; ``wandb sync`` uploads it."""

    def __init__(self, run_dir: Path, config: LoggingConfig, run_config: dict[str, Any]) -> None:
        import wandb

        self._wandb = wandb
        # console off: the coordinator's stderr stays its own log; silent: no wandb banners
        settings = wandb.Settings(mode=config.wandb_mode, silent=True, console="off")
        try:
            self._run = wandb.init(dir=str(run_dir.resolve()), project=config.wandb_project,
                                   name=run_dir.name, config=run_config, settings=settings)
        except wandb.errors.Error as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise LoggingBackendError(f"logging.backends: wandb did not start: {first}") from None

    @property
    def run_folder(self) -> Path:
        """The run's own folder (``offline-run-<time>-<id>``), the one ``wandb sync`` takes."""
        return Path(self._run.dir).parent

    def write(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()
        self._wandb.teardown()  # stops the wandb-core service this process started
