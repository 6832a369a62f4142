"""One CTB round's tentative view of the ranks (:class:`Draft`): what the policy's decisions so far
leave of each rank's budget, and where a task fits (the headroom and, with ``project_growth``,
the rank's projected peak: :func:`~tiderl.core.footprints.projected_peak`)."""

from __future__ import annotations

from bisect import bisect_left, insort
from operator import sub

from tiderl.core.footprints import projected_peak
from tiderl.core.task_book import GroupRecord, TaskBook, TaskRecord


class Draft:
    """One round's tentative view: the book's ranks after this round's decisions so far.

    After the pause phase it only gains tasks, so a footprint that did not fit a rank (or any
    rank) earlier in a round does not fit it later in the round either, unless a sibling placed
    since shares its group's prompt there (the caches are keyed by what a task shares)."""

    __slots__ = (
        "book", "budget", "env_delta", "final", "footprints", "group_delta", "max_headroom",
        "no_fit", "num_active", "num_admitted_train", "num_empty", "num_open", "reserved",
        "usage",
    )  # fmt: skip

    def __init__(self, book: TaskBook, project_growth: bool = False):
        self.book = book
        self.budget = {r: rec.budget for r, rec in book.ranks.items()}
        self.usage = {r: rec.usage for r, rec in book.ranks.items()}
        self.num_active = {r: len(rec.active) for r, rec in book.ranks.items()}
        self.num_empty = sum(1 for r, n in self.num_active.items() if self._is_open_empty(r, n))
        self.group_delta: dict[str, dict[int, int]] = {}
        self.env_delta: dict[tuple[str, int], int] = {}
        self.num_open = book.num_open_sessions
        self.num_admitted_train = book.num_admitted_train
        self.reserved: set[str] = set()  # groups whose first admission is in this round
        # the final footprint tasks grow to (None: no projection); per rank, a copy of its
        # sorted footprints once this round changed them; (rank, footprint, shared) and (None,
        # footprint, 0) that did not fit there / anywhere after the pause phase
        self.final = book.expected_footprint if project_growth else None
        self.footprints: dict[int, list[int]] = {}
        self.no_fit: set[tuple[int | None, int, int]] = set()
        self.refresh()

    def refresh(self) -> None:
        """Recompute the largest headroom; O(ranks)."""
        self.max_headroom = max(map(sub, self.budget.values(), self.usage.values()), default=-1)

    def _is_open_empty(self, rank: int, num_active: int) -> bool:
        return num_active == 0 and self.budget[rank] > 0

    def _active_on(self, group_id: str) -> dict[int, int]:
        """Per rank, the group's active tasks after this round's decisions so far."""
        counts = dict(self.book.groups[group_id].num_active_on)
        for rank, delta in self.group_delta.get(group_id, {}).items():
            counts[rank] = counts.get(rank, 0) + delta
        return counts

    def group_shares(self, group: GroupRecord) -> int:
        """The prompt a task of ``group`` shares on some rank (0: on none): its group's, where
        another of its tasks is active (after this round's decisions so far)."""
        if not group.prompt_tokens:
            return 0
        on = any(n > 0 for n in self._active_on(group.group_id).values())
        return group.prompt_tokens if on else 0

    def shared(self, task: TaskRecord, rank: int, *, is_on: bool = False) -> int:
        """The KV ``task`` shares on ``rank`` with its group's other tasks active there (after
        this round's decisions so far; ``is_on``: the task is one of them): its group's
        prompt, where another is there (``TaskBook.prompt_block_tokens``)."""
        group = self.book.groups[task.group_id]
        if not group.prompt_tokens:
            return 0
        others = (group.num_active_on.get(rank, 0) - is_on
                  + self.group_delta.get(task.group_id, {}).get(rank, 0))
        return group.prompt_tokens if others > 0 else 0

    def fits(self, footprint: int, rank: int, shared: int = 0) -> bool:
        """Within the headroom (and the projected peak within the budget), or alone on an empty
        rank with a budget, however large it is (else a task bigger than every budget could
        never run: it runs alone instead); ``shared`` of its footprint already held there."""
        if footprint - shared <= self.budget[rank] - self.usage[rank]:
            return self._peak_fits(footprint, rank, shared)
        return self._is_open_empty(rank, self.num_active[rank])

    def _peak_fits(self, footprint: int, rank: int, shared: int = 0) -> bool:
        """Whether the rank's projected peak with one more task of ``footprint`` (``shared`` of
        it held already) stays within its budget (always, without projection). The peak is
        projected on the tasks' whole footprints, less what they share now."""
        if self.final is None or self.num_active[rank] == 0:
            return True
        key = (rank, footprint, shared)
        if key in self.no_fit:
            return False
        footprints = list(self.footprints.get(rank, self.book.ranks[rank].footprints))
        insort(footprints, footprint)
        peak = projected_peak(footprints, self.final)
        if peak - (sum(footprints) - self.usage[rank] - footprint + shared) <= self.budget[rank]:
            return True
        self.no_fit.add(key)
        return False

    def fits_somewhere(self, footprint: int, shared: int = 0) -> bool:
        """Within the headroom of some rank (necessary: the rank found may refuse it by its
        projected peak), less ``shared`` (what it shares on some rank: ``group_shares``), and
        a task of its footprint that shares nowhere not refused by every rank earlier in the
        round."""
        if footprint - shared > (float("inf") if self.num_empty else self.max_headroom):
            return False  # inlined largest_fit(): this is called for every task a round pops
        return shared or not self.no_fit or (None, footprint, 0) not in self.no_fit

    def fits_nowhere(self, footprint: int, shared: int = 0) -> None:
        """No rank took a task of ``footprint`` that shares nowhere: none takes one for the rest
        of the round (one that shares may fit where it does)."""
        if not shared:
            self.no_fit.add((None, footprint, 0))

    def holds(self, num_tasks: int) -> bool:
        """Whether the ranks' expected headroom holds ``num_tasks`` more tasks grown to the
        footprint finished tasks reached (F, measured: some task finished, or the growth bound
        before that): then probing a group's first turn cannot protect a budget, it only delays
        the siblings."""
        grown = self.book.expected_footprint
        if grown <= 0 or not self.book.is_footprint_measured:
            return False
        room = sum(max(0.0, self.budget[r] - max(self.usage[r], n * grown)) // grown
                   for r, n in self.num_active.items())
        return room >= num_tasks

    def projects(self, task: TaskRecord) -> bool:
        """Whether each task placed is judged grown to a measured F (some task finished, or the
        growth bound before that) from a measured first turn (its hint, or its environment's
        probes): then a group's probe measures nothing its siblings' placement needs, and
        waiting for it only delays them."""
        book = self.book
        return (self.final is not None and book.is_footprint_measured
                and (task.footprint_hint is not None or task.env in book.footprints.first_turns))

    def largest_fit(self) -> float:
        """The largest footprint within the headroom of some rank."""
        return float("inf") if self.num_empty else self.max_headroom

    def take_off(self, task: TaskRecord) -> None:
        self._move(task, task.rank, -1)

    def put_on(self, task: TaskRecord, rank: int) -> None:
        was_roomiest = self.budget[rank] - self.usage[rank] >= self.max_headroom
        self._move(task, rank, 1)
        if was_roomiest:
            self.refresh()

    def _move(self, task: TaskRecord, rank: int, sign: int) -> None:
        if self.final is not None:
            footprints = self.footprints.get(rank)
            if footprints is None:
                footprints = self.footprints[rank] = list(self.book.ranks[rank].footprints)
            if sign > 0:
                insort(footprints, task.footprint)
            else:
                del footprints[bisect_left(footprints, task.footprint)]
        self.num_empty -= self._is_open_empty(rank, self.num_active[rank])
        self.usage[rank] += sign * (task.footprint - self.shared(task, rank, is_on=sign < 0))
        self.num_active[rank] += sign
        self.num_empty += self._is_open_empty(rank, self.num_active[rank])
        deltas = self.group_delta.setdefault(task.group_id, {})
        deltas[rank] = deltas.get(rank, 0) + sign
        key = (task.env, rank)
        self.env_delta[key] = self.env_delta.get(key, 0) + sign

    def sibling_rank(self, task: TaskRecord) -> int | None:
        """The rank where it fits holding most active tasks of its group (ties: lower id)."""
        ranked = sorted((-n, rank) for rank, n in self._active_on(task.group_id).items() if n > 0)
        return next((rank for _, rank in ranked
                     if self.fits(task.footprint, rank, self.shared(task, rank))), None)

    def roomiest_rank(self, task: TaskRecord, penalty: int) -> int | None:
        """The rank where it fits maximising its expected headroom - penalty x active tasks of
        its env there (ties: lower id).

        The expected headroom counts each active task at least at the footprint tasks grow to
        (``TaskBook.expected_footprint`` F): budget - max(usage, active tasks x F). By its
        current usage alone a rank that joined holds young tasks' small footprints, so one
        admission burst lands on it whole; as those tasks grow together it decodes several
        times the others' batch and its groups finish last (measured on sim/cluster32: 118
        tasks on the new rank against 20-48 on the others, 7.9 M tokens discarded as stale)."""
        scores, best = self._scores(task, penalty)
        if best is None or self._peak_fits(task.footprint, best, self.shared(task, best)):
            return best
        # the best rank's projected peak refuses it: the next best, in order
        ranked = sorted((-score, rank) for rank, score in scores.items() if rank != best)
        return next((rank for _, rank in ranked
                     if self._peak_fits(task.footprint, rank, self.shared(task, rank))), None)

    def _scores(self, task: TaskRecord, penalty: int) -> tuple[dict[int, float], int | None]:
        """Per rank within whose headroom it is: its expected headroom - the penalty; and the
        rank scoring best (ties: lower id)."""
        scores: dict[int, float] = {}
        best, best_score, footprint = None, 0.0, task.footprint
        grown = self.book.expected_footprint
        prompt = self.book.groups[task.group_id].prompt_tokens
        for rank, usage in self.usage.items():
            budget, num_active = self.budget[rank], self.num_active[rank]
            cost = footprint - self.shared(task, rank) if prompt else footprint
            if cost > budget - usage and not self._is_open_empty(rank, num_active):
                continue  # it is not within the headroom (inlined fits(): this loop is hot)
            score = budget - max(usage, num_active * grown)  # before the penalty
            if penalty:
                same_env = self.book.ranks[rank].num_env.get(task.env, 0)
                score -= penalty * (same_env + self.env_delta.get((task.env, rank), 0))
            scores[rank] = score
            if best is None or score > best_score:
                best, best_score = rank, score
        return scores, best
