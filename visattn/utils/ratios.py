"""The paired time ratio: how the benches and ``impl="auto"``'s probe compare two functions timed in the same
rounds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def round_ratios(samples: Sequence[float], reference: Sequence[float]) -> list[float]:
    """``samples[i] / reference[i]`` for the rounds both were timed in (the shorter list's)."""
    return [a / b for a, b in zip(samples, reference, strict=False)]


def median_ratio(samples: Sequence[float], reference: Sequence[float]) -> float:
    """The median over rounds of each round's ratio (``round_ratios``). Each round's ratio cancels what the
    round shared, the machine's speed at that moment; a ratio of the two medians, or of the two best times,
    does not, as they can come from rounds a slow spell separated."""
    return statistics.median(round_ratios(samples, reference))
