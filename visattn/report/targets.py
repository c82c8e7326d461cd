"""Did the study's recipe reach what it was chosen for? The reference (MHA) cell's quality against the
targets its profile states (``targets:`` in conf/study/full.yaml: DiT class agreement >= 0.80 and
recall >= 0.30, i.e. recognisable and varied samples), with the seeds' 95% interval. A comparison of
variants means little where the reference itself misses them, so the report says which way it went.
"""

from __future__ import annotations

from collections.abc import Mapping

from .metrics import QUALITY, Metric, quality_metrics
from .runs import Cell
from .stats import Summary, summarize
from .tables import format_summary, markdown_table

Targets = Mapping[str, Mapping[str, float]]  # {task: {metric key: target}}


def target_verdict(summary: Summary | None, target: float, higher_is_better: bool) -> str:
    """Where the seeds put the metric relative to ``target``: met or missed only where the whole 95%
    interval lies on one side; otherwise the side of the mean and that the interval holds the target."""
    if summary is None:
        return "not measured"
    side = 1.0 if higher_is_better else -1.0
    mean_ok = side * (summary.mean - target) >= 0
    if not summary.has_interval:
        return f"{'met' if mean_ok else 'missed'} by the one seed (no interval)"
    low, high = sorted((side * (summary.low - target), side * (summary.high - target)))
    if low >= 0:
        return "met (the 95% interval clears the target)"
    if high < 0:
        return "missed (the 95% interval falls short of the target)"
    return f"mean {'meets' if mean_ok else 'misses'} it; the 95% interval holds the target (not settled)"


def _metric(task: str, key: str) -> Metric:
    metrics = {metric.key: metric for metric in quality_metrics(task)}
    if not metrics:
        raise ValueError(f"targets: task {task!r} has no quality metrics; use one of {sorted(QUALITY)}")
    if key not in metrics:
        raise ValueError(f"target {task}.{key}: {key!r} is not a quality metric of task {task!r}; "
                         f"use one of {sorted(metrics)}")
    return metrics[key]


def check_targets(targets: Targets) -> None:
    """ValueError naming the first target that is not a quality metric of its task (checked before a
    study starts, not hours later when its report is written)."""
    for task, per_metric in targets.items():
        for key in per_metric:
            _metric(task, key)


def target_table(reference: Cell, targets: Mapping[str, float]) -> str:
    """One row per target: the reference cell's mean ± std [95% CI] over its seeds and the verdict."""
    rows = []
    for key, target in targets.items():
        metric = _metric(reference.task, key)
        summary = summarize(reference.values(key))
        bound = ">=" if metric.higher_is_better else "<="
        rows.append([metric.label, f"{bound} {target * metric.scale:.{metric.digits}f}",
                     format_summary(summary, metric.scale, metric.digits),
                     target_verdict(summary, float(target), metric.higher_is_better)])
    return markdown_table(["metric", "target", f"{reference.variant} (seeds: {len(reference.runs)})", "verdict"],
                          rows)
