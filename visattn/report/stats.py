"""Seed statistics: mean, std and a Student-t 95% interval, and the honest comparison built on them.

Two cells are ranked only when both have an interval (n >= 2 seeds) and the intervals do not
overlap; otherwise the difference is reported as inside the seed noise (or not ranked for n = 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats as scipy_stats

CONFIDENCE = 0.95
BETTER, WORSE, WITHIN_NOISE, NOT_RANKED, REFERENCE = "better", "worse", "within noise", "not ranked (n<2)", "reference"


@dataclass(frozen=True)
class Summary:
    """Summary of one metric over the seeds of a cell; ``low``/``high`` are None when n < 2."""

    n: int
    mean: float
    std: float | None
    low: float | None
    high: float | None

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    @property
    def half_width(self) -> float | None:
        return None if not self.has_interval else (self.high - self.low) / 2


def summarize(values: Sequence[float]) -> Summary | None:
    """Mean, sample std (ddof=1) and the 95% t-interval of ``values``; None when there are none."""
    values = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(values)
    if n == 0:
        return None
    mean = sum(values) / n
    if n == 1:
        return Summary(n=1, mean=mean, std=None, low=None, high=None)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(scipy_stats.t.ppf(0.5 + CONFIDENCE / 2, df=n - 1)) * std / math.sqrt(n)
    return Summary(n=n, mean=mean, std=std, low=mean - half, high=mean + half)


def intervals_overlap(a: Summary, b: Summary) -> bool:
    """True when the two 95% intervals share at least one point (both must have intervals)."""
    if not (a.has_interval and b.has_interval):
        raise ValueError("intervals_overlap needs two summaries with n >= 2 (an interval each)")
    return a.low <= b.high and b.low <= a.high


def compare(candidate: Summary | None, reference: Summary | None, higher_is_better: bool) -> str:
    """``better`` / ``worse`` only when both 95% intervals exist and do not overlap; else
    ``within noise`` (overlap) or ``not ranked (n<2)`` (an interval is missing); ``—`` when unmeasured."""
    if candidate is None or reference is None:
        return "—"
    if not (candidate.has_interval and reference.has_interval):
        return NOT_RANKED
    if intervals_overlap(candidate, reference):
        return WITHIN_NOISE
    above = candidate.mean > reference.mean
    return BETTER if above == higher_is_better else WORSE
