"""Where each task runs: CTB's decisions turned into bus messages, and tasks moved between ranks.

    Admit(t, r) ──AdmitTask──> r
    Pause(t) ──PauseTask──> its rank          Resume(t, r) on its rank ──ResumeTask──> r
    Pause(t) of a task in transit: the move is called off, its carry waits for a resume
    Resume(t, r') elsewhere ──DetachTask──> old rank ──TaskDetached(carry)──> AdmitTask ──> r'
    a rank left rollout: its tasks' carries come back with TaskDetached, one per task
    a rank died: its tasks restart from scratch (no carry) wherever CTB resumes them

Invariant: a task runs on at most one rank; a moved task is admitted on its new rank only once
its carry (environment session, turns, next context) is back and that rank is in CTB's book.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from tiderl.core.types import Admit, Decision, Pause, Resume
from tiderl.runtime import bus as b
from tiderl.runtime.groups import GroupRun


class TaskRouter:
    def __init__(self, send: Callable[[int, b.Message], None], next_seq: Callable[[], int],
                 group_of: Callable[[str], GroupRun],
                 rollout_ranks: Callable[[], Collection[int]], pins_tasks: bool) -> None:
        self._send, self._next_seq = send, next_seq
        self._group_of = group_of  # a task's group (CTB's book knows it)
        self._rollout_ranks = rollout_ranks  # ranks in CTB's book (their engine is up)
        self.pins_tasks = pins_tasks
        self.task_rank: dict[str, int] = {}
        self.carries: dict[str, b.CarryData | None] = {}  # moved tasks: carry (None: restart)
        self.moves: dict[str, int] = {}  # task -> rank it goes to once its carry arrives

    def apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            if isinstance(d, Admit):
                self.admit(d.task_id, d.rank)
            elif isinstance(d, Pause):
                self.pause(d.task_id)
            elif isinstance(d, Resume):
                if self.task_rank.get(d.task_id) == d.rank and d.task_id not in self.carries:
                    self._send(d.rank, b.ResumeTask(seq=self._next_seq(), task_id=d.task_id))
                else:
                    self._move(d.task_id, d.rank)

    def admit(self, task_id: str, rank: int, carry: b.CarryData | None = None) -> None:
        group = self._group_of(task_id)
        spec = group.tasks[task_id]
        self.task_rank[task_id] = rank
        self._send(rank, b.AdmitTask(seq=self._next_seq(), task_id=task_id,
                                     group_id=group.group_id, env=spec.env,
                                     task=group.task_text, seed=spec.seed, eval=spec.is_eval,
                                     pin=self.pins_tasks, carry=carry))

    def pause(self, task_id: str) -> None:
        """Pause it on its rank; a task in transit (moved, not yet admitted on its new rank) is
        already off every rank: the move is called off and its carry waits for a resume."""
        if task_id in self.moves or task_id not in self.task_rank:
            self.moves.pop(task_id, None)
            self.task_rank.pop(task_id, None)
            return
        self._send(self.task_rank[task_id], b.PauseTask(seq=self._next_seq(), task_id=task_id))

    def _move(self, task_id: str, rank: int) -> None:
        """Resume elsewhere: from its carry once the old rank has sent it (or from scratch when
        its rank died)."""
        if task_id in self.carries:
            self.admit(task_id, rank, self.carries.pop(task_id))
            return
        old = self.task_rank.get(task_id)
        self.moves[task_id] = rank
        if old is not None:
            self._send(old, b.DetachTask(seq=self._next_seq(), task_id=task_id))

    def on_detached(self, msg: b.TaskDetached) -> None:
        target = self.moves.pop(msg.task_id, None)
        if target is not None and target in self._rollout_ranks():
            self.admit(msg.task_id, target, msg.carry)
        else:
            self.carries[msg.task_id] = msg.carry

    def on_finished(self, task_id: str) -> None:
        self.task_rank.pop(task_id, None)

    def on_joined(self, rank: int) -> None:
        """``rank`` is in CTB's book: the tasks moved to it whose carry is back start there."""
        for task_id, target in list(self.moves.items()):
            if target == rank and task_id in self.carries:
                del self.moves[task_id]
                self.admit(task_id, rank, self.carries.pop(task_id))

    def on_left(self, rank: int, task_ids: tuple[str, ...], is_dead: bool,
                is_known: Callable[[str], bool]) -> None:
        """``rank`` left rollout. Alive, it detaches every task and their carries come back;
        dead, the tasks that were active or paused there restart from scratch."""
        if not is_dead:
            for task_id in task_ids:
                self.task_rank.pop(task_id, None)  # its carry comes back with TaskDetached
            return
        for task_id, where in list(self.task_rank.items()):
            if where == rank and is_known(task_id):
                self.carries[task_id] = None
                del self.task_rank[task_id]
                target = self.moves.pop(task_id, None)
                if target is not None:
                    self._move(task_id, target)
