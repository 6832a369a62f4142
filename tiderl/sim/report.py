"""Plots of experiment results (PNG, matplotlib's Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from tiderl.sim.experiments import ExperimentResult, device_shares


def write_plots(result: ExperimentResult, out_dir: Path) -> list[Path]:
    """One PNG per series group (per-step lines) and one bar chart of the table's main figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for metric, lines in result.series.items():
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for label, ys in lines.items():
            ax.plot(range(len(ys)), ys, label=label, linewidth=1.2)
        ax.set_xlabel("step")
        ax.set_ylabel(metric)
        ax.set_title(f"{result.name}: {metric} per step")
        ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / f"{result.name}_{metric}.png"))
    if result.device_s:
        paths.append(_device_bars(result, out_dir))
    key = _bar_key(result)
    if key:
        labels = [str(row.get("run", row.get("step_mode"))) for row in result.rows]
        values = [float(row[key]) for row in result.rows]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar(range(len(values)), values)
        ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(key)
        ax.set_title(f"{result.name}: {key}")
        fig.tight_layout()
        paths.append(_save(fig, out_dir / f"{result.name}_{key}.png"))
    return paths


def _device_bars(result: ExperimentResult, out_dir: Path) -> Path:
    """One stacked bar per run: its GPU-seconds by what they did, in % of gpus x wall."""
    import matplotlib.pyplot as plt

    shares = device_shares(result.device_s)
    keys = [k for k in shares[0] if k != "run"]
    fig, ax = plt.subplots(figsize=(8, 4))
    bottoms = [0.0] * len(shares)
    colors = plt.get_cmap("tab20").colors
    for i, key in enumerate(keys):
        values = [row[key] for row in shares]
        ax.bar(range(len(shares)), values, bottom=bottoms, label=key, color=colors[i % 20])
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_xticks(range(len(shares)), [row["run"] for row in shares], fontsize=8)
    ax.set_ylabel("% of GPU-seconds")
    ax.set_title(f"{result.name}: where the GPU-seconds went")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return _save(fig, out_dir / f"{result.name}_device_s.png")


def _bar_key(result: ExperimentResult) -> str | None:
    for key in ("goodput_tok_s", "step_s", "kv_hit_rate"):
        if result.rows and all(key in row for row in result.rows):
            return key
    return None


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_sweep_heatmap(result, path: Path) -> Path:
    """One PNG: tiderl over async and async over sync on the environment grid (median x sigma)
    of a :class:`tiderl.sim.sweep.SweepResult`, each cell annotated with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tiderl.sim.sweep import heatmap_cells

    keys = ("tiderl_over_async", "tiderl_over_sync", "async_over_sync")
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4))
    for ax, key in zip(axes, keys, strict=True):
        medians, sigmas, values = heatmap_cells(result, key)
        grid = [[float("nan") if v is None else v for v in row] for row in values]
        image = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(medians)), [f"{m:g}" for m in medians])
        ax.set_yticks(range(len(sigmas)), [f"{s:g}" for s in sigmas])
        ax.set_xlabel("env step median (s)")
        ax.set_ylabel("env step sigma")
        ax.set_title(key.replace("_over_", " / "))
        for i, row in enumerate(values):
            for j, value in enumerate(row):
                if value is not None:
                    ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white")
        fig.colorbar(image, ax=ax)
    centre = result.centre
    fig.suptitle(f"sweep, {result.grid.steps} steps: eta={centre['max_staleness']}, "
                 f"colocate switch {centre['colocate_switch_s']:g} s", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, path)
