"""What `tiderl top` draws: a :class:`TopState` folded from the coordinator's PUB snapshots and
:func:`render`, a pure function of that state and ``now`` (no terminal, socket or clock here).

Times are the caller's monotonic clock: ``fold(snap, now)`` stamps when a snapshot arrived, and
``render(state, now)`` shows its age, and "disconnected" once it is older than ``stale_s``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tiderl.runtime.bus import RankMetrics, Snapshot

STALE_S = 3.0  # no snapshot for longer than this (the coordinator sends one every 0.5 s)
HISTORY_LEN = 40  # steps kept per sparkline
SPARK_CHARS = "▁▂▃▄▅▆▇█"
BAR_WIDTH = 12
# (metrics key, label, format of the last value): the per-step histories under the ranks table
HISTORY_KEYS = (
    ("goodput_tok_s", "goodput", "{:.1f} tok/s"),
    ("reward_mean", "reward", "{:.3f}"),
    ("ras", "RAS", "{:g}"),
    ("tprm_s", "TPRM", "{:.3f} s"),
)


def sparkline(values: Iterable[float], width: int = HISTORY_LEN) -> str:
    """The last ``width`` values as block characters, scaled between their min and max (a flat
    series is drawn at mid height)."""
    points = [v for v in values if math.isfinite(v)][-width:]
    if not points:
        return ""
    low, high = min(points), max(points)
    if high == low:
        return SPARK_CHARS[len(SPARK_CHARS) // 2 - 1] * len(points)
    top = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[round((v - low) / (high - low) * top)] for v in points)


def usage_bar(used: int, capacity: int, width: int = BAR_WIDTH) -> str:
    """``used`` of ``capacity`` as a bar of ``width`` cells (full cells █, empty ░)."""
    if capacity <= 0:
        return ""
    filled = min(width, round(width * used / capacity))
    return "█" * filled + "░" * (width - filled)


@dataclass
class TopState:
    """Everything the view shows: the last snapshot, when it came, per-step histories."""

    job: str
    endpoint: str
    started_at: float  # when top started watching (monotonic)
    last: Snapshot | None = None
    last_at: float | None = None  # when ``last`` arrived (monotonic)
    num_snapshots: int = 0
    is_job_ended: bool = False
    history: dict[str, deque[float]] = field(default_factory=lambda: {
        key: deque(maxlen=HISTORY_LEN) for key, _, _ in HISTORY_KEYS})
    history_step: float | None = None  # the step record the histories end with

    def fold(self, snap: Snapshot, now: float) -> None:
        """Take in one snapshot; a new step record adds one point to each history."""
        self.last, self.last_at = snap, now
        self.num_snapshots += 1
        record_step = snap.metrics.get("step")
        if record_step is None or record_step == self.history_step:
            return
        self.history_step = record_step
        for key, values in self.history.items():
            if key in snap.metrics:  # absent: None in the record (e.g. TPRM before 2 ready)
                values.append(snap.metrics[key])

    def silence_s(self, now: float) -> float:
        """Seconds since the last snapshot (since top started, before the first one)."""
        return now - (self.started_at if self.last_at is None else self.last_at)

    def is_connected(self, now: float, stale_s: float = STALE_S) -> bool:
        return self.last_at is not None and now - self.last_at <= stale_s


def render(state: TopState, now: float, stale_s: float = STALE_S) -> RenderableType:
    """The whole view: header panel, sparklines, ranks table (last: on a short terminal, many
    ranks are what gets cut off)."""
    parts: list[RenderableType] = [_header(state, now, stale_s)]
    if state.last is not None:
        parts += [_history_table(state), _ranks_table(state.last)]
    return Group(*parts)


def _status(state: TopState, now: float, stale_s: float) -> Text:
    silence = state.silence_s(now)
    if state.is_job_ended:
        text = Text("job ended", style="bold yellow")
        return text.append(f" (last snapshot {silence:.1f} s ago); q quits", style="yellow")
    if state.is_connected(now, stale_s):
        return Text.assemble(("connected", "bold green"), f" (last update {silence:.1f} s ago)")
    if state.last_at is None and silence <= stale_s:
        return Text(f"waiting for the first snapshot ({silence:.1f} s)", style="yellow")
    return Text(f"disconnected (no snapshot for {silence:.0f} s) — reconnecting",
                style="bold red")


def _header(state: TopState, now: float, stale_s: float) -> Panel:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("status", _status(state, now, stale_s))
    snap = state.last
    if snap is not None:
        for label, value in _header_rows(snap):
            grid.add_row(label, _plain(value))
    return Panel(grid, title=Text(f"tiderl top · {state.job}"), subtitle=Text(state.endpoint),
                 title_align="left", subtitle_align="right")


def _plain(cell: str | Text) -> Text:
    """Values from the bus are data, never rich markup."""
    return cell if isinstance(cell, Text) else Text(cell)


def _header_rows(snap: Snapshot) -> list[tuple[str, str | Text]]:
    m = snap.metrics
    rows: list[tuple[str, str | Text]] = [
        ("step", f"{snap.step}/{_num(m, 'steps', '{:.0f}')}   elapsed "
                 f"{_num(m, 'elapsed_s', '{:.1f} s')}   step time {_num(m, 'step_s', '{:.2f} s')}"
                 f"   batch {_num(m, 'batch_size', '{:.0f}')}"),
        ("ranks", f"{_role_counts(snap.roles)}   step mode {snap.step_mode or '—'}"),
        ("goodput", f"{_num(m, 'goodput_tok_s', '{:.1f} tok/s')}   trained "
                    f"{_num(m, 'trained_tokens_total', '{:.0f} tok')}"),
        ("reward", f"{_num(m, 'reward_mean', '{:.3f}')}   solved "
                   f"{_num(m, 'solved_frac', '{:.0%}')}   eval {_num(m, 'eval_reward', '{:.3f}')}"
                   f"   loss {_num(m, 'loss', '{:.4f}')}   staleness "
                   f"{_num(m, 'staleness_max', '{:.0f}')}"),
        ("readiness", f"RAS {_num(m, 'ras', '{:g}')}   TPRM {_num(m, 'tprm_s', '{:.3f} s')}"
                      f"   RWT {_num(m, 'rwt_s', '{:.2f} s')}"
                      f"   TWT {_num(m, 'twt_s', '{:.2f} s')}"),
        ("tasks", f"active {_num(m, 'active', '{:.0f}')}   paused {_num(m, 'paused', '{:.0f}')}"
                  f"   new {_num(m, 'new', '{:.0f}')}   KV hit rate "
                  f"{_num(m, 'kv_hit_rate', '{:.1%}')} (last step), {_cumulative_hits(snap)} "
                  "(all)"),
    ]
    if snap.note:
        rows.append(("note", Text(snap.note, style="magenta")))
    return rows


def _num(metrics: dict[str, float], key: str, fmt: str) -> str:
    value = metrics.get(key)
    return "—" if value is None or not math.isfinite(value) else fmt.format(value)


def _cumulative_hits(snap: Snapshot) -> str:
    queries = sum(m.prefix_queries for m in snap.ranks)
    hits = sum(m.prefix_hits for m in snap.ranks)
    return f"{hits / queries:.1%}" if queries > 0 else "—"


def _role_counts(roles: dict[int, str]) -> str:
    counts: dict[str, int] = {}
    for role in roles.values():
        counts[role] = counts.get(role, 0) + 1
    return ", ".join(f"{n} {role}" for role, n in sorted(counts.items())) or "—"


def _ranks_table(snap: Snapshot) -> Table:
    # a light box, two-space gaps and two-line headers of the narrow columns: the table fits 80
    # columns with a full bar and capacities of up to five digits
    table = Table(title="ranks", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False,
                  padding=(0, 1, 0, 0))
    for name, justify in (("rank", "right"), ("role", "left"), ("KV tokens", "left"),
                          ("used", "left"), ("CTB\nbudget", "right"), ("hit\nrate", "right"),
                          ("running", "right"), ("waiting", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    gauges = {m.rank: m for m in snap.ranks}
    for rank in sorted(set(snap.roles) | set(gauges)):
        cells = _rank_cells(rank, snap.roles.get(rank), gauges.get(rank),
                            snap.ctb_budgets.get(rank))
        table.add_row(*map(_plain, cells))
    return table


def _rank_cells(rank: int, role: str | None, gauge: RankMetrics | None,
                ctb_budget: int | None) -> list[str | Text]:
    role = role or (gauge.role if gauge else "?")  # the snapshot's roles are the current ones
    budget = "—" if ctb_budget is None else str(ctb_budget)
    if gauge is None:
        return [str(rank), role, "—", "", budget, "—", "—", "—"]
    tokens, bar = _kv_cells(gauge.kv_tokens_used, gauge.kv_tokens_capacity)
    hit = f"{gauge.prefix_hit_rate:.1%}" if gauge.prefix_queries > 0 else "—"
    return [str(rank), role, tokens, bar, budget, hit, str(gauge.running), str(gauge.waiting)]


def _kv_cells(used: int, capacity: int) -> tuple[str, Text]:
    """"used/capacity (share)" and its bar, coloured by the share; dashes without an engine."""
    if capacity <= 0:
        return "—", Text("")
    share = used / capacity
    style = "red" if share >= 0.9 else "yellow" if share >= 0.7 else "green"
    return f"{used}/{capacity} ({share:.0%})", Text(usage_bar(used, capacity), style=style)


def _history_table(state: TopState) -> Table:
    table = Table(title=f"last {HISTORY_LEN} steps", title_justify="left", show_header=False,
                  box=None, padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True, min_width=HISTORY_LEN)
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True, overflow="ellipsis")  # gives way on a narrow terminal
    for key, label, fmt in HISTORY_KEYS:
        values = state.history[key]
        last = fmt.format(values[-1]) if values else "—"
        span = f"{min(values):.4g} … {max(values):.4g}" if values else ""
        table.add_row(label, Text(sparkline(values) or "—", style="cyan"), last, span)
    return table
