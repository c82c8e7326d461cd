"""PNG plots of the report (matplotlib, Agg backend): quality against active heads and against
measured throughput, training curves, and per-layer head-load heatmaps per class (MoH Figure 3).

Error bars are 95% t-intervals over seeds; a cell with one seed is drawn without one (and says so).
Every function returns the written path, or None when the runs hold nothing to plot.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from visattn.utils.machine import machine_line  # noqa: E402

from .convergence import RankingCheck, ranking_check, values_at  # noqa: E402
from .metrics import INFERENCE_THROUGHPUT, TASK_TITLES, Metric, headline_metric  # noqa: E402
from .runs import Cell  # noqa: E402
from .stats import summarize  # noqa: E402
from .tables import head_fraction  # noqa: E402

MARKERS = "osD^vP*Xh<>pd8H"  # 15 filled markers
# 20 distinct colours: tab20's dark shades first, then its light ones (tab10 alone repeats after 10)
_TAB20 = [matplotlib.colormaps["tab20"](i) for i in range(20)]
COLORS = _TAB20[0::2] + _TAB20[1::2]
ERRORBAR_NOTE = "error bars: 95% t-interval over seeds (none for n=1)"


def _style(index: int) -> dict:
    """Colour and marker of the ``index``-th cell: both distinct for the first 15 cells, and the
    (colour, marker) pair distinct for the first 60."""
    return {"color": COLORS[index % len(COLORS)], "marker": MARKERS[index % len(MARKERS)]}


def _machine_caption(cells: Sequence[Cell]) -> str:
    """Which machine(s) the plotted runs ran on: every figure names its CPU (throughput and even
    convergence per wall-second depend on it; bf16 is fast on some CPUs and emulated on others)."""
    machines = sorted({machine_line(run.cell_info["machine"]) for cell in cells for run in cell.runs
                       if run.cell_info.get("machine")})
    return "runs on: " + "; ".join(machines) if machines else "runs on: machine not recorded"


def _save(fig, path: Path, cells: Sequence[Cell], caption_y: float = 0.0, caption: str | None = None) -> Path:
    fig.text(0.01, caption_y, caption or _machine_caption(cells), fontsize=7, ha="left", va="top", color="0.35")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _legend_outside(ax) -> None:
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)


def _metric_axis_label(metric: Metric) -> str:
    direction = "higher is better" if metric.higher_is_better else "lower is better"
    return f"{metric.label} ({direction})"


def _point(cell: Cell, key: str, scale: float = 1.0) -> tuple[float, float] | None:
    """(mean, 95% half-width or 0) of a metric, scaled; None when unmeasured."""
    summary = summarize(cell.values(key))
    if summary is None:
        return None
    return summary.mean * scale, (summary.half_width or 0.0) * scale


def quality_vs_heads(cells: Sequence[Cell], reference: Cell | None, path: Path) -> Path | None:
    """Headline metric against the fraction of MHA's heads active per token."""
    task = cells[0].task
    metric = headline_metric(task)
    if metric is None:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    drawn = 0
    for index, cell in enumerate(cells):
        y, x = _point(cell, metric.key, metric.scale), head_fraction(cell, reference)
        if y is None or x is None:
            continue
        ax.errorbar(100 * x, y[0], yerr=y[1] or None, capsize=4, linestyle="none",
                    label=f"{cell.variant} (n={len(cell.runs)})", **_style(index))
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("active heads per token (% of the MHA baseline's heads)")
    ax.set_ylabel(_metric_axis_label(metric))
    ax.set_title(f"{TASK_TITLES.get(task, task)}: {metric.label} vs active heads\n{ERRORBAR_NOTE}", fontsize=10)
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    return _save(fig, path, cells)


def _pareto_front(points: list[tuple[float, float]], higher_is_better: bool) -> list[tuple[float, float]]:
    """Points not beaten on both throughput (higher) and quality, sorted by throughput."""
    sign = 1.0 if higher_is_better else -1.0
    front = [
        (x, y) for x, y in points
        if not any(ox >= x and sign * oy >= sign * y and (ox, oy) != (x, y) for ox, oy in points)
    ]
    return sorted(front)


def quality_vs_throughput(cells: Sequence[Cell], path: Path, timing_machine: str | None = None) -> Path | None:
    """Headline metric against measured inference throughput, with the front of the means.
    ``timing_machine``: the one machine whose runs' timings the cells keep (``runs.timings_from``)."""
    task = cells[0].task
    metric = headline_metric(task)
    if metric is None:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    means = []
    for index, cell in enumerate(cells):
        y, x = _point(cell, metric.key, metric.scale), _point(cell, "eval_images_per_s")
        if y is None or x is None:
            continue
        timed = len(cell.values("eval_images_per_s"))
        seeds = f"n={len(cell.runs)}" if timed == len(cell.runs) else f"n={len(cell.runs)}, timed {timed}"
        ax.errorbar(x[0], y[0], xerr=x[1] or None, yerr=y[1] or None, capsize=4, linestyle="none",
                    label=f"{cell.variant} ({seeds})", **_style(index))
        means.append((x[0], y[0]))
    if not means:
        plt.close(fig)
        return None
    front = _pareto_front(means, metric.higher_is_better)
    ax.plot(*zip(*front, strict=True), color="0.5", linestyle="--", linewidth=1, label="front of the means")
    ax.set_xlabel(INFERENCE_THROUGHPUT.get(task, "measured inference throughput (images/s)"))
    ax.set_ylabel(_metric_axis_label(metric))
    ax.set_title(
        f"{TASK_TITLES.get(task, task)}: {metric.label} vs measured throughput (Pareto view)\n"
        f"{ERRORBAR_NOTE}; the front is drawn through means only",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    _legend_outside(ax)
    caption = f"throughput measured on: {timing_machine}" if timing_machine else None
    return _save(fig, path, cells, caption=caption)


def mean_curve(cell: Cell, x_key: str, y_key: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Mean of ``y_key`` over the seeds at each ``x_key`` value the seeds logged."""
    by_x: dict[float, list[float]] = {}
    for run in cell.runs:
        for row in run.metrics:
            x, y = row.get(x_key), row.get(y_key)
            if x is not None and y is not None:
                by_x.setdefault(x, []).append(y)
    if not by_x:
        return None
    xs = np.array(sorted(by_x))
    return xs, np.array([np.mean(by_x[x]) for x in xs])


def training_curves(cells: Sequence[Cell], path: Path) -> Path | None:
    """Training loss per step (and, for classification, eval top-1 per epoch and a close-up of the
    cells' ranking at the last two evaluations), mean over seeds."""
    task = cells[0].task
    panels = [("step", "loss", "training step", "training loss", 1.0)]
    check = None
    if task == "cls":
        panels.append(("epoch", "top1", "epoch", "eval top-1 (%)", 100.0))
        check = ranking_check(cells, "epoch", "top1")
    columns = len(panels) + (check is not None)
    fig, axes = plt.subplots(1, columns, figsize=(6.0 * columns + 2.5, 4.2), squeeze=False)
    drawn = False
    for ax, (x_key, y_key, x_label, y_label, scale) in zip(axes[0], panels, strict=False):
        for index, cell in enumerate(cells):
            curve = mean_curve(cell, x_key, y_key)
            if curve is None:
                continue
            style = _style(index)
            ax.plot(curve[0], curve[1] * scale, color=style["color"], marker=style["marker"], markersize=3,
                    linewidth=1.2, label=f"{cell.variant} (mean of {len(cell.runs)})")
            drawn = True
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    if not drawn:
        plt.close(fig)
        return None
    fig.suptitle(f"{TASK_TITLES.get(task, task)}: training curves (mean over seeds)", fontsize=11)
    if check is None:
        _legend_outside(axes[0][-1])
        return _save(fig, path, cells)
    _last_evaluations(axes[0][-1], cells, check, "epoch", "top1", "eval top-1 (%)", 100.0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(labels), 5),
               fontsize=8, frameon=False)
    return _save(fig, path, cells, caption_y=-0.06 - 0.045 * -(-len(labels) // 5))


def _last_evaluations(ax, cells: Sequence[Cell], check: RankingCheck, x_key: str, y_key: str, y_label: str,
                      scale: float) -> None:
    """The checked cells at the last two evaluations: seed mean with its 95% interval, one line per
    cell (slightly offset so the intervals do not hide each other), labelled with its final rank."""
    by_label = {cell.label: (index, cell) for index, cell in enumerate(cells)}
    width = 0.3 * (check.points[1] - check.points[0])
    for rank, label in enumerate(check.after):
        index, cell = by_label[label]
        style = _style(index)
        offset = width * (rank / max(len(check.after) - 1, 1) - 0.5)
        xs, ys, errs = [], [], []
        for point in check.points:
            summary = summarize(list(values_at(cell, x_key, y_key)[point].values()))
            xs.append(point + offset)
            ys.append(summary.mean * scale)
            errs.append((summary.half_width or 0.0) * scale)
        ax.errorbar(xs, ys, yerr=errs, color=style["color"], marker=style["marker"], markersize=4, capsize=2,
                    linewidth=1.0, label=f"{rank + 1}. {label}")
    which = "core cells" if check.core_only else "cells"
    verdict = "order holds (swaps within seed noise)" if check.stable else "order NOT settled"
    ax.set_title(f"{which} at the last two evaluations: {verdict}", fontsize=9)
    ax.set_xticks(list(check.points))
    ax.set_xlabel(x_key)
    ax.set_ylabel(f"{y_label}: seed mean, 95% t-interval")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=7, frameon=False, title="rank at last")


def _mean_head_load(cell: Cell) -> tuple[dict, list[np.ndarray], int] | None:
    """The first seed's head_load layout, and per layer the [classes, heads] load averaged over the
    seeds whose layout matches it."""
    loads = [run.head_load for run in cell.runs if run.head_load]
    if not loads:
        return None
    first = loads[0]
    same = [h for h in loads if h.get("classes") == first.get("classes") and h.get("heads") == first.get("heads")]
    per_layer = [np.mean([np.asarray(h["load"][layer], dtype=float) for h in same], axis=0)
                 for layer in range(int(first["layers"]))]
    return first, per_layer, len(same)


def head_load_heatmaps(cell: Cell, path: Path) -> Path | None:
    """One heatmap per layer: classes (rows) x heads (columns), colour = fraction of the class's
    tokens that used the head."""
    layout = _mean_head_load(cell)
    if layout is None:
        return None
    info, per_layer, seeds = layout
    classes = [str(c) for c in info.get("classes", [])]
    layers = len(per_layer)
    cols = min(layers, 4)
    rows = -(-layers // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols + 1.2, 0.25 * len(classes) * rows + 1.8 * rows),
                             squeeze=False, layout="constrained")
    image = None
    for layer, ax in enumerate(axes.flat):
        if layer >= layers:
            ax.axis("off")
            continue
        load = per_layer[layer]
        image = ax.imshow(load, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", interpolation="nearest")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("head index", fontsize=8)
        ax.set_xticks(range(load.shape[1]))
        ax.set_yticks(range(len(classes)))
        ax.set_yticklabels(classes if layer % cols == 0 else [], fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        if layer % cols == 0:
            ax.set_ylabel("class", fontsize=8)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8,
                 label="share of the class's tokens\nusing the head")
    fig.suptitle(
        f"{TASK_TITLES.get(cell.task, cell.task)} · {cell.variant} ({cell.budget} heads): "
        f"head load per class and layer, mean of {seeds} seed(s)",
        fontsize=10,
    )
    return _save(fig, path, [cell])
