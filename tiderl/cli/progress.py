"""The progress line of a running job, as ``tiderl launch`` shows it on stderr while it follows
the coordinator's snapshots."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tiderl.cli.output import Output

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult

    from tiderl.runtime.bus import Snapshot


class JobProgress:
    """How the launcher shows a running job on stderr (nothing with ``--json``).

    On a terminal: one line redrawn in place (rich Live), fitted to the terminal's width on
    every redraw: the step counter always shows, and the other fields are dropped, least
    important first, when they do not fit. Elsewhere (a pipe, a file): one plain line per
    step, as the step ends."""

    def __init__(self, out: Output, steps: int):
        self.out, self.steps = out, steps
        self.is_live = out.err_console.is_terminal and not out.json_mode
        self.live = None
        self.started = time.monotonic()
        self.snap: Snapshot | None = None
        self.first: tuple[float, int] | None = None  # (when, step) of the first snapshot
        self.stepped_at = self.started  # when the step last changed
        self.printed_step = 0

    def start(self) -> None:
        self.started = time.monotonic()
        if self.is_live:
            from rich.live import Live

            self.live = Live(self, console=self.out.err_console, refresh_per_second=2)
            self.live.start()

    def update(self, snap: Snapshot) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = (now, snap.step)
        if self.snap is None or snap.step != self.snap.step:
            self.stepped_at = now
        self.snap = snap
        if self.out.json_mode or self.is_live:
            return
        if snap.step > self.printed_step:  # (a resumed job's first line: where it goes on)
            self.printed_step = snap.step
            self.out.note(progress_line(self.fields(now), None))

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def fields(self, now: float) -> list[tuple[int, str]]:
        """(priority, text) in display order; priority 0 always shows, higher drops first."""
        return progress_fields(self.snap, self.steps, now - self.started, self._eta(now))

    def _eta(self, now: float) -> float | None:
        """The mean step time since the first snapshot times the steps left, counted down from
        the last step's end."""
        if self.snap is None or self.first is None or self.snap.step <= self.first[1]:
            return None
        since, step0 = self.first
        per_step = (self.stepped_at - since) / (self.snap.step - step0)
        return max(0.0, per_step * (self.steps - self.snap.step) - (now - self.stepped_at))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        from rich.text import Text

        line = progress_line(self.fields(time.monotonic()), options.max_width)
        yield Text(line, no_wrap=True, overflow="ellipsis")


def progress_fields(snap: Snapshot | None, steps: int, elapsed_s: float,
                    eta_s: float | None) -> list[tuple[int, str]]:
    """The progress line's fields, (priority, text) in display order: the step counter (0,
    always shown), the time, reward, goodput, the step mode, the roles, the tasks."""
    clock = _duration(elapsed_s) + (f" eta {_duration(eta_s)}" if eta_s is not None else "")
    if snap is None:
        return [(0, f"step 0/{steps}"), (1, clock), (2, "starting ...")]
    m = snap.metrics
    fields = [(0, f"step {snap.step}/{steps}"), (1, clock)]
    if snap.step >= steps:
        fields.append((2, "finishing (the last weights, the report) ..."))
    if "reward_mean" in m:
        fields.append((2, f"reward {m['reward_mean']:.3f}"))
    if "goodput_tok_s" in m:
        fields.append((3, f"goodput {m['goodput_tok_s']:.0f} tok/s"))
    if snap.step_mode:
        fields.append((4, f"{snap.step_mode} steps"))
    roles: dict[str, int] = {}
    for role in snap.roles.values():
        roles[role] = roles.get(role, 0) + 1
    fields.append((5, "roles " + " ".join(f"{r} {n}" for r, n in sorted(roles.items()))))
    fields.append((6, f"tasks {m.get('active', 0):.0f} active {m.get('paused', 0):.0f} paused"))
    return fields


def progress_line(fields: list[tuple[int, str]], width: int | None) -> str:
    """The fields that fit in ``width`` columns (all of them for None), most important first,
    in display order; the priority-0 fields always."""
    sep = "  "
    kept: set[int] = set()
    used = 0
    for i, (priority, text) in sorted(enumerate(fields), key=lambda item: item[1][0]):
        cost = len(text) + (len(sep) if kept else 0)
        if priority == 0 or width is None or used + cost <= width:
            kept.add(i)
            used += cost
    return sep.join(text for i, (_, text) in enumerate(fields) if i in kept)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
