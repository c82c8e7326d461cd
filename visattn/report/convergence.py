"""Did training run long enough to rank? The cells' order by an evaluation metric at the last two
evaluations (mean over seeds at the same epoch / step), whether it changed, and whether the pairs
that swapped places differ by more than seed noise.

A study's core cells (``core: true`` in conf/study/cells.yaml) are the ones checked when the runs
say which they are; otherwise every cell is. Two cells a few hundredths of a point apart swap
places from one evaluation to the next by chance; such a swap does not mean training is too short.
A swap counts against the ranking only where the pair's paired-by-seed difference at the last
evaluation is significant (two-sided p <= 0.05, uncorrected, so the check errs towards "changed").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from .runs import Cell
from .stats import FAMILY_ALPHA, PairedDifference, paired_difference


@dataclass(frozen=True)
class Swap:
    """Two cells whose order changed: ``ahead`` is ahead at the last evaluation, ``behind`` was
    ahead before; ``difference`` is ahead - behind (paired by seed) at the last evaluation."""

    ahead: str
    behind: str
    difference: PairedDifference

    @property
    def tested(self) -> bool:
        return self.difference.p_value is not None  # n >= 2 seeds with spread

    @property
    def beyond_noise(self) -> bool:
        return self.tested and self.difference.p_value <= FAMILY_ALPHA


@dataclass(frozen=True)
class RankingCheck:
    points: tuple[float, float]  # the last two evaluation points (e.g. epochs)
    before: tuple[str, ...]  # cell labels, best first, at points[0]
    after: tuple[str, ...]  # at points[1]
    swaps: tuple[Swap, ...] = ()
    core_only: bool = False  # the check covers the study's core cells only

    @property
    def stable(self) -> bool:
        """The order is the same, or changed only between cells shown to be within seed noise of each
        other (a swap that cannot be tested, with one seed, does not count as stable)."""
        return all(swap.tested and not swap.beyond_noise for swap in self.swaps)


def values_at(cell: Cell, x_key: str, y_key: str) -> dict[float, dict]:
    """``{x: {seed: y}}`` of every evaluation the cell's runs logged."""
    out: dict[float, dict] = {}
    for run in cell.runs:
        for row in run.metrics:
            x, y = row.get(x_key), row.get(y_key)
            if x is not None and y is not None:
                out.setdefault(float(x), {})[run.seed] = float(y)
    return out


def ranking_check(cells: Sequence[Cell], x_key: str, y_key: str, higher_is_better: bool = True) -> RankingCheck | None:
    """Order of the cells (the core cells when any are marked) by the seed mean of ``y_key`` at the
    last two ``x_key`` values that every one of them logged; None when fewer than two cells or two
    shared evaluations exist."""
    core = [cell for cell in cells if cell.core]
    chosen = core if len(core) >= 2 else list(cells)
    values = {cell.label: values_at(cell, x_key, y_key) for cell in chosen}
    values = {label: by_x for label, by_x in values.items() if by_x}
    if len(values) < 2:
        return None
    shared = sorted(set.intersection(*(set(by_x) for by_x in values.values())))
    if len(shared) < 2:
        return None
    first, last = shared[-2], shared[-1]

    def mean(label: str, x: float) -> float:
        seeds = values[label][x]
        return sum(seeds.values()) / len(seeds)

    def order(x: float) -> tuple[str, ...]:
        return tuple(sorted(values, key=lambda label: mean(label, x), reverse=higher_is_better))

    before, after = order(first), order(last)
    swaps = []
    for a, b in combinations(after, 2):  # a is ahead of b at the last evaluation
        if before.index(a) > before.index(b):
            diff = paired_difference(values[a][last], values[b][last])
            if diff is not None:
                swaps.append(Swap(a, b, diff))
    return RankingCheck((first, last), before, after, tuple(swaps), core_only=chosen is core)


def _swap_text(swap: Swap, scale: float, unit: str) -> str:
    d = swap.difference
    interval = f" [{d.low * scale:+.2f}, {d.high * scale:+.2f}]" if d.low is not None else f" (n={d.n})"
    return f"{swap.ahead} over {swap.behind} by {d.mean * scale:+.2f}{unit}{interval}"


def ranking_sentence(check: RankingCheck | None, x_label: str, y_label: str, scale: float = 1.0,
                     unit: str = "") -> str:
    """A few lines (one paragraph each) for the report under the training curves; ``scale`` and
    ``unit`` format the differences (e.g. 100 and " pp" for a fraction shown in percentage points)."""
    if check is None:
        return f"Ranking by {y_label}: fewer than two shared evaluations, so its stability is not checked."
    which = "core cells" if check.core_only else "cells"
    first, last = (f"{x_label} {p:g}" for p in check.points)
    head = f"Ranking of the {which} by seed-mean {y_label}"
    if not check.swaps:
        return f"{head} is the same at {first} and {last} (best first: {', '.join(check.after)})."
    groups = (
        ("within seed noise", [s for s in check.swaps if s.tested and not s.beyond_noise]),
        ("BEYOND seed noise", [s for s in check.swaps if s.beyond_noise]),
        ("not tested (fewer than 2 seeds, or no spread)", [s for s in check.swaps if not s.tested]),
    )
    lines = [f"{head} changed between {first} ({', '.join(check.before)}) and {last} ({', '.join(check.after)})."]
    for name, swaps in groups:
        if swaps:
            lines.append(f"Swaps {name} at {last} (difference paired by seed, 95% interval): "
                         + "; ".join(_swap_text(swap, scale, unit) for swap in swaps) + ".")
    if check.stable:
        lines.append("Every swap is within seed noise: the order of the cells that differ holds.")
    else:
        lines.append("So the ranking is not settled: training may be too short to rank these cells.")
    return "\n".join(lines)
