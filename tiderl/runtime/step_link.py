"""The open step on the bus: its messages out, its ranks' reports back.

    StartStep ──TrainStep──> the step's ranks       AbortStep ──AbortStep──> its live ranks
    Dispatch ──MicroBatchData (the samples)──>      CloseStep ──StepClosed──>
    StepDone / StepFailed of the open attempt ──> reports; complete once every live rank of the
        attempt answered ──> (the adapter) StepOutcome ──> StepController.step_done

A failure with every rank of the step alive is the job's failure, but only after the heartbeat
window: a rank that died in the step's collective is then the one named (its peers' "connection
closed" is its consequence), and with a dead rank, or an attempt the step controller aborted
(the last rollout rank died while it was open on a batch with no group), the failures are the
step controller's to settle (the step runs again, or was trained). The samples of a dispatched
micro-batch are kept until the step is done, so that an attempt a rank died in can be sent
again.

With ``logging.batches`` the step that trained goes to its file then (:mod:`.recording`: its
start, its micro-batches as sent, its ranks' reports). With ``runtime.train`` false
(``is_training``) nothing goes to the ranks: a step is complete, with a report of no update
from each of its ranks, once its batch is (an attempt a trainer rank died in: once it is
aborted); the controller records it as not trained and runs the boundary after it as after an
update (the weights it carries are the ones the ranks had).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tiderl.core import commands as c
from tiderl.core.records import reward_summary
from tiderl.profile import Profile
from tiderl.runtime import bus as b
from tiderl.runtime.errors import CoordinatorError
from tiderl.runtime.recording import BatchTape, batch_tape
from tiderl.runtime.trajectory_wire import sample_data
from tiderl.trainer.sample import TrainSample


class StepLink:
    def __init__(self, send: Callable[[int, b.Message], None], next_seq: Callable[[], int],
                 window_s: float, tape: BatchTape | None = None,
                 is_training: bool = True) -> None:
        self._send, self._next_seq = send, next_seq
        self.window_s = window_s  # how long heartbeats take to name a dead rank
        self.tape, self.is_training = tape, is_training
        self.dispatched: list[b.MicroBatchData] = []  # the attempt's, in order
        self.start: c.StartStep | None = None  # the open attempt
        self.reports: dict[int, c.RankReport] = {}
        self.failed_at: float | None = None  # the attempt's first failure, while unexplained
        self.is_aborted = False  # the controller aborted the attempt: its failures are that
        self.errors: dict[int, str] = {}
        self.sent: dict[str, tuple[TrainSample, float]] = {}  # dispatched: sample, reward
        self.rewards: list[float] = []  # the attempt's samples', as dispatched
        self.groups: set[str] = set()  # the step's groups, as dispatched

    @classmethod
    def of(cls, profile: Profile, run_dir: Path, send: Callable[[int, b.Message], None],
           next_seq: Callable[[], int], window_s: float) -> StepLink:
        """The link of a job of ``profile``: its tape (``logging.batches``), whether it trains."""
        return cls(send, next_seq, window_s, batch_tape(profile, run_dir), profile.runtime.train)

    def send(self, command: c.StartStep | c.Dispatch | c.CloseStep | c.AbortStep,
             samples: dict[str, TrainSample], rewards: dict[str, float],
             dead: set[int]) -> None:
        """``samples`` / ``rewards``: the ready ones, by sequence id (a dispatched one moves
        here until the step is done)."""
        if isinstance(command, c.StartStep):
            self.start, self.reports, self.errors = command, {}, {}
            self.failed_at, self.rewards, self.dispatched = None, [], []
            self.is_aborted = False
            msg: b.Message = b.TrainStep(
                seq=self._next_seq(), step=command.step, step_mode=command.step_mode,
                ref_ranks=list(command.ref_ranks), actor_ranks=list(command.actor_ranks),
                max_aggregate=command.max_aggregate, attempt=command.attempt)
        elif isinstance(command, c.Dispatch):
            assert self.start is not None
            data = []
            for seq in command.mb.sequences:
                if seq.seq_id not in self.sent:
                    self.sent[seq.seq_id] = (samples.pop(seq.seq_id),
                                             rewards.pop(seq.seq_id))
                sample, reward = self.sent[seq.seq_id]
                self.groups.add(sample.seq_id.rsplit(".", 1)[0])
                self.rewards.append(reward)
                data.append(sample_data(sample))
            msg = b.MicroBatchData(seq=self._next_seq(), step=command.step,
                                   mb_id=command.index, samples=data,
                                   attempt=self.start.attempt)
            self.dispatched.append(msg)
        elif isinstance(command, c.CloseStep):
            assert self.start is not None
            msg = b.StepClosed(seq=self._next_seq(), step=command.step,
                               attempt=self.start.attempt)
        else:
            msg = b.AbortStep(seq=self._next_seq(), step=command.step, attempt=command.attempt)
            self.is_aborted = True
        assert self.start is not None
        if not self.is_training:  # the ranks run no step: its end is known here
            if isinstance(command, c.CloseStep | c.AbortStep):
                failed = isinstance(command, c.AbortStep)
                self.reports = {r: c.RankReport(r, failed=failed) for r in self.start.ranks}
            return
        for rank in self.start.ranks:
            if rank not in dead:
                self._send(rank, msg)

    def is_of_open_attempt(self, msg: b.StepDone | b.StepFailed) -> bool:
        start = self.start
        return start is not None and msg.step == start.step and msg.attempt == start.attempt \
            and msg.rank in start.ranks

    def on_done(self, msg: b.StepDone) -> None:
        stats = msg.stats
        self.reports[msg.rank] = c.RankReport(
            msg.rank, wait_s=stats.get("wait_s", 0.0), t_ref=stats.get("t_ref"),
            t_act_f=stats.get("t_act_f"), t_act_b=stats.get("t_act_b"),
            t_swap=stats.get("t_swap"), loss=msg.loss, grad_norm=msg.grad_norm,
            loss_tokens=msg.loss_tokens)

    def on_failed(self, msg: b.StepFailed, now: float) -> None:
        if msg.updated:  # its weights moved on while its peers' may not have: not repairable
            raise CoordinatorError(f"rank {msg.rank} failed after its optimizer step in step "
                                   f"{msg.step}: {msg.error}")
        self.reports[msg.rank] = c.RankReport(msg.rank, failed=True)
        self.errors[msg.rank] = msg.error
        if self.failed_at is None:
            self.failed_at = now

    def complete(self, dead: set[int], now: float) -> tuple[c.RankReport, ...] | None:
        """The open attempt's reports once every live rank of it answered and any failure is
        explained by a dead rank of it; None until then. A failure still unexplained after the
        heartbeat window is the job's (CoordinatorError)."""
        start = self.start
        if start is None:
            return None
        explained = self.is_aborted or any(r in dead for r in start.ranks)
        if self.failed_at is not None and not explained:
            if now - self.failed_at > self.window_s:
                rank = min(self.errors)
                raise CoordinatorError(f"rank {rank} failed: {self.errors[rank]}")
            return None
        live = [r for r in start.ranks if r not in dead]
        if any(r not in self.reports for r in live):
            return None
        return tuple(self.reports[r] for r in live)

    def outcome(self, dead: set[int], now: float, kv_counters: tuple[int, int],
                eval_reward: float | None) -> c.StepOutcome | None:
        """The open attempt's outcome once ``complete``: its reports, the prefix-cache counters
        of every rollout rank now, the rewards of the samples it trained."""
        reports = self.complete(dead, now)
        if reports is None:
            return None
        assert self.start is not None
        reward_mean, solved_frac = reward_summary(self.rewards)
        return c.StepOutcome(self.start.step, reports, kv_queries=kv_counters[0],
                             kv_hits=kv_counters[1], reward_mean=reward_mean,
                             solved_frac=solved_frac, eval_reward=eval_reward,
                             is_trained=self.is_training)

    def done(self) -> set[str]:
        """The step trained (or, not training, was taken): its groups. With a tape, its file."""
        if self.tape is not None and self.start is not None:
            self.tape.record(self.start, self.dispatched, self.rewards,
                             list(self.reports.values()), self.is_training)
        groups, self.dispatched = self.groups, []
        self.start, self.reports, self.sent, self.groups = None, {}, {}, set()
        return groups

    def reopen(self) -> None:
        """The attempt settled without training (the step runs again): wait for the next."""
        self.start = None
