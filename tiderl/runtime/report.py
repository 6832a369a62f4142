"""Run report: three PNGs and a Markdown summary of a training run folder.

A job writes `runs/<job>/metrics.jsonl` (one :class:`~tiderl.core.records.StepRecord` per
optimizer step) and `events.jsonl` (one object per event). `write_report` reads both and writes,
beside them:

    goodput_reward.png   goodput (from 0), reward and solved fraction vs time
    roles.png            ranks per role vs time (stacked)
    readiness.png        RAS/TPRM plane, one colour and marker per mode, colocated drawn on
                         top; a step without a TPRM (< 2 later micro-batches) is a triangle on
                         the RAS axis
    report.md            summary table, per-step table, role changes, the three images, and
                         the TensorBoard logdir and wandb runs the job wrote (logging.backends)

The PNGs take a few seconds of matplotlib; ``report.plots: false`` in the profile leaves them
out (report.md says so), as the tests of jobs that do not look at them do. A PNG that cannot be
written (a full disk: any ``OSError``) is left out, and report.md says in one line which and why;
a report.md that cannot be written is a :class:`ReportError` naming it, which
`write_final_report` (the coordinator's, at the job's end) logs as one line.

The report is of the run folder's live lineage (:func:`.lineage.read_lineage`: a resume's
discarded records and events are left out, and it says how many); `summarize` gives the
summary numbers alone (the benchmarks reuse it). `goodput_reward_figure` and `readiness_figure`
build the figures the PNGs are saved from. Plots use matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiderl.core.records import StepRecord
from tiderl.runtime.lineage import Lineage, ReportError, Row, read_lineage
from tiderl.runtime.log_backends import TENSORBOARD_DIR, WANDB_DIR

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger("tiderl.report")

ROLE_LETTERS = {"rollout": "R", "ref": "F", "actor": "A", "idle": "I"}
IMAGES = ("goodput_reward.png", "roles.png", "readiness.png")
REPORT_FILE = "report.md"
STEP_COLUMNS = ("step", "time (s)", "step_mode", "roles", "RAS", "TPRM (s)", "goodput (tok/s)",
                "reward", "loss", "staleness")
# readiness plane: (colour, marker, z-order) per mode; colocated on top of the others
MODE_STYLE = {"decoupled": ("tab:blue", "o", 2), "vs": ("tab:green", "^", 2),
              "vso": ("tab:red", "D", 2), "batch": ("tab:purple", "P", 2),
              "colocated": ("tab:orange", "s", 3)}


def summarize(metrics: list[StepRecord]) -> Row:
    """The summary table's numbers. Values are None where the run has nothing to say.

    Goodput "last half" averages `metrics[n // 2:]`; `num_role_changes` counts, between
    consecutive steps, the ranks whose role differs.
    """
    if not metrics:
        return {"num_steps": 0}
    last = metrics[-1]
    half = metrics[len(metrics) // 2 :]
    evals = [m.eval_reward for m in metrics if m.eval_reward is not None]
    kv = [m.kv_hit_rate for m in metrics if m.kv_hit_rate is not None]
    kept = [m.kv_retention for m in metrics if m.kv_retention is not None]
    tail = metrics[-3:]
    return {
        "num_steps": len(metrics),
        "wall_time_s": last.time_s,
        "trained_tokens_total": last.trained_tokens_total,
        "goodput_end_tok_s": round(last.goodput_tok_s, 2),
        "goodput_last_half_mean_tok_s": _mean([round(m.goodput_tok_s, 2) for m in half]),
        "generated_tokens_total": last.generated_tokens_total,
        "discarded_tokens_total": last.discarded_tokens_total,
        "reward_first": metrics[0].reward_mean,
        "reward_last3_mean": _mean([m.reward_mean for m in tail if m.reward_mean is not None]),
        "eval_reward_first": evals[0] if evals else None,
        "eval_reward_last": evals[-1] if evals else None,
        "staleness_max": max(m.staleness_max for m in metrics),
        "kv_hit_rate_mean": _mean(kv),
        "kv_retention_mean": _mean(kept),
        "rwt_total_s": sum(m.rwt_s for m in metrics),
        "twt_total_s": sum(m.twt_s for m in metrics),
        "modes": dict(Counter(m.step_mode.value for m in metrics)),
        "num_role_changes": sum(
            _num_changed(list(prev.roles), list(cur.roles)) for prev, cur in pairwise(metrics)
        ),
    }


def write_report(run_dir: Path, *, title: str | None = None, plots: bool = True) -> Path:
    """Write the three PNGs (when there are steps and ``plots``: the profile's
    ``report.plots``) and `report.md` into `run_dir`. A PNG that cannot be written is left out
    (report.md says which and why); ReportError when report.md itself cannot be written."""
    run_dir = Path(run_dir)
    lineage = read_lineage(run_dir)  # what a resume discarded is left out
    metrics = lineage.metrics
    failed = _draw_images(metrics, run_dir) if metrics and plots else {}
    lines = [f"# {title or f'Run report: {run_dir.name}'}", ""]
    if (run_dir / "profile.yaml").exists():
        lines += ["Resolved profile: [profile.yaml](profile.yaml)", ""]
    lines += _tracking_section(run_dir)
    lines += _summary_section(summarize(metrics))
    lines += _steps_section(metrics)
    lines += _events_section(lineage)
    if metrics:
        lines += ["## Figures", "", *_figures(plots, failed)]
    path = run_dir / REPORT_FILE
    try:
        path.write_text("\n".join(lines))
    except OSError as exc:
        _remove(path)  # what part of it fit would read as the whole
        raise ReportError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def write_final_report(run_dir: Path, *, title: str, plots: bool) -> Path | None:
    """:func:`write_report` at a job's end: its path, or None once one line naming the file
    and the error is logged (no traceback: the job's outcome and its resume line stand)."""
    try:
        path = write_report(run_dir, title=title, plots=plots)
    except (ReportError, OSError) as exc:  # OSError: a run file that cannot be read
        log.error("no report: %s", exc)
        return None
    log.info("report: %s", path)
    return path


def _draw_images(metrics: list[StepRecord], run_dir: Path) -> dict[str, str]:
    """Save the three PNGs into ``run_dir``; the ones that could not be written (an OSError: a
    full disk, no permission), each with why. Such a PNG is removed: a cut-short file is no
    figure."""
    draw: dict[str, Callable[[], Figure]] = {
        IMAGES[0]: lambda: goodput_reward_figure(metrics),
        IMAGES[1]: lambda: roles_figure(metrics),
        IMAGES[2]: lambda: readiness_figure(metrics),
    }
    failed = {}
    for name, figure in draw.items():
        try:
            save_figure(figure(), run_dir / name)
        except OSError as exc:
            failed[name] = exc.strerror or str(exc)
            _remove(run_dir / name)
    if failed:
        log.warning("report figures left out: %s", _left_out(failed))
    return failed


def _figures(plots: bool, failed: dict[str, str]) -> list[str]:
    """The Figures section's lines: a link per PNG written, one line for those left out."""
    if not plots:
        return ["Not drawn (the profile's report.plots is false).", ""]
    lines = [line for name in IMAGES if name not in failed
             for line in (f"![{name[:-4]}]({name})", "")]
    if failed:
        lines += [f"Left out, as they could not be written: {_left_out(failed)}.", ""]
    return lines


def _left_out(failed: dict[str, str]) -> str:
    """``a.png, b.png (No space left on device)``: the PNGs grouped by their error."""
    by_error: dict[str, list[str]] = {}
    for name, error in failed.items():
        by_error.setdefault(error, []).append(name)
    return "; ".join(f"{', '.join(names)} ({error})" for error, names in by_error.items())


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):  # it may not be there, or be a folder
        path.unlink()


def compact_roles(roles: list[str]) -> str:
    """Per-rank roles as counts, e.g. ["rollout", "actor", "rollout"] -> "R2 A1"."""
    counts = Counter(roles)
    order = [*ROLE_LETTERS, *sorted(set(counts) - set(ROLE_LETTERS))]
    return " ".join(f"{ROLE_LETTERS.get(r, r)}{counts[r]}" for r in order if counts[r])


def _tracking_section(run_dir: Path) -> list[str]:
    """Where the job's TensorBoard event files and wandb runs are, and the command that opens
    each (nothing when it wrote neither)."""
    lines = []
    logdir = run_dir / TENSORBOARD_DIR
    if any(logdir.glob("events.out.tfevents.*")):
        lines.append(f"- TensorBoard: [{TENSORBOARD_DIR}/]({TENSORBOARD_DIR}/); "
                     f"`tensorboard --logdir {logdir.resolve()}`")
    for folder in sorted((run_dir / WANDB_DIR).glob("*run-*")):
        if folder.name.startswith("offline-run-"):
            lines.append(f"- wandb offline run: [{folder.name}]({WANDB_DIR}/{folder.name}); "
                         f"`wandb sync {folder.resolve()}` uploads it")
        elif folder.name.startswith("run-"):
            lines.append(f"- wandb run: [{folder.name}]({WANDB_DIR}/{folder.name})")
    return ["## Experiment tracking", "", *lines, ""] if lines else []


def _summary_section(s: Row) -> list[str]:
    if not s["num_steps"]:
        return ["## Summary", "", "No steps recorded (metrics.jsonl missing or empty).", ""]
    modes = ", ".join(f"{mode}: {n}" for mode, n in s["modes"].items())
    rows = [
        ("steps", s["num_steps"]),
        ("wall time (s)", _fmt(s["wall_time_s"], 1)),
        ("trained tokens", s["trained_tokens_total"]),
        ("goodput at end (tok/s)", _fmt(s["goodput_end_tok_s"], 1)),
        ("mean goodput, last half of steps (tok/s)", _fmt(s["goodput_last_half_mean_tok_s"], 1)),
        ("generated tokens", s["generated_tokens_total"]),
        ("discarded tokens", s["discarded_tokens_total"]),
        ("reward: first step / mean of last 3",
         f"{_fmt(s['reward_first'])} / {_fmt(s['reward_last3_mean'])}"),
        ("eval reward: first / last",
         f"{_fmt(s['eval_reward_first'])} / {_fmt(s['eval_reward_last'])}"),
        ("max staleness", s["staleness_max"]),
        ("mean KV hit rate", _fmt(s["kv_hit_rate_mean"])),
        ("mean KV retention", _fmt(s["kv_retention_mean"])),
        ("total RWT / TWT (s)", f"{_fmt(s['rwt_total_s'], 2)} / {_fmt(s['twt_total_s'], 2)}"),
        ("modes (steps)", modes),
        ("role changes (rank-steps)", s["num_role_changes"]),
    ]
    return ["## Summary", "", "| metric | value |", "|---|---|",
            *(f"| {k} | {v} |" for k, v in rows), ""]


def _steps_section(metrics: list[StepRecord]) -> list[str]:
    if not metrics:
        return []
    lines = ["## Steps", "", "Roles: R rollout, F ref, A actor, I idle.", "",
             "| " + " | ".join(STEP_COLUMNS) + " |", "|" + "---|" * len(STEP_COLUMNS)]
    for m in metrics:
        cells = [m.step, _fmt(m.time_s, 1), m.step_mode.value, compact_roles(list(m.roles)), m.ras,
                 _fmt(m.tprm_s, 2), _fmt(m.goodput_tok_s, 1), _fmt(m.reward_mean),
                 _fmt(m.loss, 4), m.staleness_max]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return [*lines, ""]


def _events_section(lineage: Lineage) -> list[str]:
    events = lineage.events
    if not events:
        return ["## Events", "", "No events recorded (events.jsonl missing or empty).", ""]
    kinds = ", ".join(f"{k}: {n}" for k, n in Counter(e["kind"] for e in events).items())
    changes = [e for e in events if e["kind"] == "role_change"]
    lines = ["## Events", "", f"Event counts: {kinds}.", "", "Role changes:", ""]
    lines += [f"- t={_fmt(e['time_s'], 1)} s, step {e.get('step')}: rank {e.get('rank')} "
              f"{e.get('src')} -> {e.get('dst')}" for e in changes] or ["- none"]
    return [*lines, "", *_faults_section(events), *_discarded_section(lineage)]


def _discarded_section(lineage: Lineage) -> list[str]:
    """What the report leaves out of metrics.jsonl and events.jsonl: a resume discarded it."""
    if not lineage.num_discarded_records and not lineage.num_discarded_events:
        return []
    return ["Left out, as a resume discarded them (what the run before it did after the "
            "checkpoint it went on from; still in metrics.jsonl and events.jsonl): step records "
            f"{lineage.num_discarded_records}, events {lineage.num_discarded_events}.", ""]


def _faults_section(events: list[Row]) -> list[str]:
    """How the job ended, and what went wrong on the way (docs/runtime.md, Faults)."""
    stops = [e for e in events if e["kind"] == "stop"]
    ended = (f"{stops[-1].get('state', 'ok')}: {stops[-1].get('reason')}" if stops
             else "no stop event (the coordinator was killed)")
    lines = ["## Faults", "", f"Ended: {ended}."]
    if stops and stops[-1].get("resume"):
        lines.append(f"To go on: {stops[-1]['resume']}.")
    lines.append("")
    drops = Counter(e.get("reason") for e in events if e["kind"] == "dropped_group")
    rows = [(f"resumed from step {e.get('version')}",
             f"{len(e.get('ready', []))} ready groups restored, "
             f"{len(e.get('rerun', []))} rolling out run again") for e in events
            if e["kind"] == "resume"]
    rows += [(f"rank {e.get('rank')} ({e.get('role')}) dead", e.get("why", ""))
             for e in events if e["kind"] == "rank_dead"]
    rows += [(f"step {e.get('step')} trained at attempt {e['attempt']}",
              "a trainer rank died in the attempt before; the ranks left ran it again")
             for e in events if e["kind"] == "trained" and e.get("attempt")]
    rows += [(f"rank {e.get('rank')}: environment sessions ended",
              str(e["ended"]) if e.get("ended") is not None else e.get("error", ""))
             for e in events if e["kind"] == "env_sessions_ended"]
    rows += [(f"groups dropped: {reason}", str(n)) for reason, n in drops.items()]
    rows += [(f"watchdog at {_fmt(e['time_s'], 1)} s",
              f"no progress for {e.get('idle_s')} s in phase {e.get('phase')}")
             for e in events if e["kind"] == "watchdog"]
    for kind in ("message_dropped", "handler_error"):
        count = sum(1 + e.get("repeats", 0) for e in events if e["kind"] == kind)
        if count:
            rows.append((kind.replace("_", " "), str(count)))
    if not rows:
        return [*lines, "None.", ""]
    return [*lines, "| fault | detail |", "|---|---|",
            *(f"| {what} | {detail} |" for what, detail in rows), ""]


def goodput_reward_figure(metrics: list[StepRecord]) -> Figure:
    """Goodput (its axis from 0), train and eval reward, and the solved fraction vs time."""
    plt = pyplot()
    t = [m.time_s for m in metrics]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(7, 6.5), sharex=True)
    top.plot(t, [m.goodput_tok_s for m in metrics], linewidth=1.2)
    top.set_ylim(bottom=0)
    top.set_ylabel("goodput (tok/s)")
    top.set_title("Goodput, reward and solved fraction")
    middle.plot(t, _values(m.reward_mean for m in metrics), linewidth=1.2, label="train reward")
    evals = [(m.time_s, m.eval_reward) for m in metrics if m.eval_reward is not None]
    if evals:
        xs, ys = zip(*evals, strict=True)
        middle.scatter(xs, ys, color="tab:red", zorder=3, label="eval reward")
    middle.set_ylabel("reward")
    middle.legend(fontsize=8)
    bottom.plot(t, _values(m.solved_frac for m in metrics), linewidth=1.2, color="tab:green")
    bottom.set_ylim(0, 1.05)
    bottom.set_xlabel("time (s)")
    bottom.set_ylabel("solved fraction")
    return fig


def roles_figure(metrics: list[StepRecord]) -> Figure:
    """Ranks per role vs time, stacked."""
    plt = pyplot()
    counts = [Counter(m.roles) for m in metrics]
    roles = [r for r in ROLE_LETTERS if any(c[r] for c in counts)]
    roles += sorted({r for c in counts for r in c} - set(ROLE_LETTERS))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.stackplot([m.time_s for m in metrics], [[c[r] for c in counts] for r in roles],
                 labels=roles, step="pre")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("ranks")
    ax.set_title("Roles over time")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def plot_readiness(metrics: list[StepRecord], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(readiness_figure(metrics), path)
    return path


def readiness_figure(metrics: list[StepRecord]) -> Figure:
    """The RAS/TPRM plane: one colour and marker per mode, colocated drawn above the others;
    a step whose TPRM is null is a triangle of its mode's colour on the RAS axis."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for mode in dict.fromkeys(m.step_mode.value for m in metrics):
        colour, marker, zorder = MODE_STYLE.get(mode, ("tab:gray", "X", 2))
        steps = [m for m in metrics if m.step_mode.value == mode]
        known = [m for m in steps if m.tprm_s is not None]
        if known:
            ax.scatter([m.ras for m in known], [m.tprm_s for m in known], label=mode,
                       color=colour, marker=marker, alpha=0.7, zorder=zorder)
        nulls = [m.ras for m in steps if m.tprm_s is None]
        if nulls:  # x in data, y on the axis line (axes fraction 0), over the spine
            ax.scatter(nulls, [0.0] * len(nulls), transform=ax.get_xaxis_transform(),
                       label=f"{mode}, TPRM null (on the RAS axis)", color=colour, marker="v",
                       alpha=0.7, zorder=zorder + 2, clip_on=False)
            ax.update_datalim([(x, 0.0) for x in nulls], updatey=False)  # the axis spans them
    if metrics:
        ax.legend(fontsize=8)
    ax.autoscale_view()
    ax.set_ylim(0, None if any(m.tprm_s is not None for m in metrics) else 1.0)
    ax.set_xlabel("RAS (ready at start)")
    ax.set_ylabel("TPRM (s)")
    num_null = sum(m.tprm_s is None for m in metrics)
    ax.set_title(f"RAS/TPRM per step ({num_null} with TPRM null: triangles on the RAS axis)")
    return fig


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Figure, path: Path) -> None:
    """``fig`` as a PNG at ``path``, then closed (also when the write fails)."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def _num_changed(prev: list[str], cur: list[str]) -> int:
    """Ranks whose role differs; a rank that appears or disappears counts as one change."""
    return sum(a != b for a, b in zip(prev, cur, strict=False)) + abs(len(prev) - len(cur))


def _values(values: Iterable[float | None]) -> list[float]:
    """A series for a line plot: None (nothing to say that step) as a gap."""
    return [math.nan if v is None else v for v in values]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"
