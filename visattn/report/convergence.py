"""Did training run long enough to rank? The cells' order by an evaluation metric at the last two
evaluations (mean over seeds at the same epoch / step), and whether it changed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .plots import mean_curve
from .runs import Cell


@dataclass(frozen=True)
class RankingCheck:
    points: tuple[float, float]  # the last two evaluation points (e.g. epochs)
    before: tuple[str, ...]  # variants, best first, at points[0]
    after: tuple[str, ...]  # at points[1]

    @property
    def stable(self) -> bool:
        return self.before == self.after


def ranking_check(cells: Sequence[Cell], x_key: str, y_key: str, higher_is_better: bool = True) -> RankingCheck | None:
    """Order of the cells by the seed mean of ``y_key`` at the last two ``x_key`` values that every
    cell logged; None when fewer than two cells or two shared evaluations exist."""
    curves = {cell.variant: mean_curve(cell, x_key, y_key) for cell in cells}
    curves = {name: dict(zip(*curve, strict=True)) for name, curve in curves.items() if curve is not None}
    if len(curves) < 2:
        return None
    shared = sorted(set.intersection(*(set(c) for c in curves.values())))
    if len(shared) < 2:
        return None
    points = (shared[-2], shared[-1])

    def order(x: float) -> tuple[str, ...]:
        return tuple(sorted(curves, key=lambda name: curves[name][x], reverse=higher_is_better))

    return RankingCheck((float(points[0]), float(points[1])), order(points[0]), order(points[1]))


def ranking_sentence(check: RankingCheck | None, x_label: str, y_label: str) -> str:
    """One line for the report under the training curves."""
    if check is None:
        return f"Ranking by {y_label}: fewer than two shared evaluations, so its stability is not checked."
    first, last = (f"{x_label} {p:g}" for p in check.points)
    if check.stable:
        return (f"Ranking by seed-mean {y_label} is the same at {first} and {last} "
                f"(best first: {', '.join(check.after)}).")
    return (f"Ranking by seed-mean {y_label} CHANGED between {first} ({', '.join(check.before)}) and {last} "
            f"({', '.join(check.after)}): training may be too short to rank these cells.")
