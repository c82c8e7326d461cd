"""Which results.json keys the report shows, how they read, and which direction is better."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool
    scale: float = 1.0  # display multiplier (fractions -> percent)
    digits: int = 2


QUALITY = {
    "cls": (
        Metric("top1", "top-1 (%)", True, 100.0),
        Metric("top1_best", "best-epoch top-1 (%)", True, 100.0),
        Metric("top5", "top-5 (%)", True, 100.0),
    ),
    "dit": (
        Metric("fid", "FID", False),
        Metric("class_agreement", "class agreement", True, digits=3),
        Metric("sfid", "sFID", False),
        Metric("is", "IS", True),
        Metric("precision", "precision", True, digits=3),
        Metric("recall", "recall", True, digits=3),
    ),
}
# The metric each task's plots put on the y axis.
HEADLINE = {"cls": QUALITY["cls"][0], "dit": QUALITY["dit"][0]}
TASK_TITLES = {"cls": "Classification", "dit": "Generation (DiT)"}
# What eval_images_per_s measures per task.
INFERENCE_THROUGHPUT = {
    "cls": "measured inference throughput (images/s)",
    "dit": "measured sampling throughput (generated images/s, whole sampling chain)",
}


def quality_metrics(task: str) -> tuple[Metric, ...]:
    return QUALITY.get(task, ())


def headline_metric(task: str) -> Metric | None:
    return HEADLINE.get(task)
