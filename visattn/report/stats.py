"""Seed statistics: mean, std and a Student-t 95% interval per cell, and paired comparisons.

Comparisons are paired by seed (the same seed means the same data order and, for the same
architecture, the same initial weights): per shared seed, d = candidate - reference; the paired t
interval of the mean difference and its two-sided p value (``paired_difference``). A table's
verdicts form one family: Holm's step-down correction (``holm``) at family-wise alpha = 0.05 decides
which differences are called better or worse; every other one reads "within noise".
``compare`` (interval overlap of two unpaired cells) remains for single comparisons.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scipy import stats as scipy_stats

CONFIDENCE = 0.95
FAMILY_ALPHA = 1 - CONFIDENCE  # Holm's family-wise error rate over one table's verdicts
BETTER, WORSE, WITHIN_NOISE, NOT_RANKED, REFERENCE = "better", "worse", "within noise", "not ranked (n<2)", "reference"
SPREAD_RTOL = 1e-9  # per-seed differences whose std is below this x the values' magnitude have no spread
NO_SPREAD = "not tested (no spread)"  # n >= 2 but every per-seed difference equal: t is undefined


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


@dataclass(frozen=True)
class PairedDifference:
    """candidate - reference over the ``n`` seeds both have; p is None when n < 2 or the differences
    have no spread (no test), the interval when n < 2."""

    n: int
    mean: float
    low: float | None
    high: float | None
    p_value: float | None


def paired_difference(candidate: Mapping[Any, float], reference: Mapping[Any, float]) -> PairedDifference | None:
    """Paired t statistics of ``candidate[seed] - reference[seed]`` over the seeds both measured
    (``{seed: value}``); None when they share no seed. Zero spread leaves the test undefined (p None:
    not ranked): with a handful of seeds it comes from a metric at its floor or ceiling (recall 0 for
    every run), not from a difference measured without noise."""
    seeds = [s for s in candidate if s in reference and _finite(candidate[s]) and _finite(reference[s])]
    if not seeds:
        return None
    diffs = [float(candidate[s]) - float(reference[s]) for s in seeds]
    summary = summarize(diffs)
    if not summary.has_interval:
        return PairedDifference(1, summary.mean, None, None, None)
    # Spread at floating-point rounding level (0.0003 - 0.0001 vs 0.0002) counts as none.
    scale = max(abs(float(v)) for s in seeds for v in (candidate[s], reference[s]))
    if summary.std <= SPREAD_RTOL * scale:
        return PairedDifference(summary.n, summary.mean, summary.low, summary.high, None)
    t = summary.mean / (summary.std / math.sqrt(summary.n))
    p_value = float(2 * scipy_stats.t.sf(abs(t), df=summary.n - 1))
    return PairedDifference(summary.n, summary.mean, summary.low, summary.high, p_value)


def _finite(value: Any) -> bool:
    return value is not None and math.isfinite(float(value))


def holm(p_values: Sequence[float | None], alpha: float = FAMILY_ALPHA) -> list[bool | None]:
    """Holm's step-down test over the non-None p values: sorted ascending, p_(i) is rejected while
    p_(i) <= alpha / (m - i + 1) (i = 1..m), and nothing after the first that is not. Returns, per
    input, True (rejected), False (kept) or None (no test)."""
    tested = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    m = len(tested)
    rejected: list[bool | None] = [None if p is None else False for p in p_values]
    for rank, (p, index) in enumerate(tested):
        if p > alpha / (m - rank):
            break
        rejected[index] = True
    return rejected


def paired_verdicts(differences: Sequence[PairedDifference | None], higher_is_better: Sequence[bool]) -> list[str]:
    """One table's family of paired differences -> verdicts: better / worse where Holm rejects,
    within noise where it does not, not ranked with fewer than 2 shared seeds or differences without
    spread, — when unmeasured."""
    rejected = holm([None if d is None else d.p_value for d in differences])
    out = []
    for diff, reject, higher in zip(differences, rejected, higher_is_better, strict=True):
        if diff is None:
            out.append("—")
        elif reject is None:
            out.append(NOT_RANKED if diff.n < 2 else NO_SPREAD)
        elif not reject:
            out.append(WITHIN_NOISE)
        else:
            out.append(BETTER if (diff.mean > 0) == higher else WORSE)
    return out
