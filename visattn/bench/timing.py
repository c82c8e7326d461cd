"""Wall-clock timing: interleaved medians (machine drift hits every variant alike) and the
machine's matmul peak measured in the same process."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    # CPU seconds of this process: on a machine shared with other jobs, time spent waiting for a
    # core is not counted (with one thread, the closest to an idle machine's wall time)
    "cpu": time.process_time,
}


def interleaved_times(
    fns: Mapping[str, Callable[[], object]], warmup: int = 2, repeats: int = 10, clock: str = "wall"
) -> dict[str, list[float]]:
    """Seconds per call of each function, sampled round-robin: ``repeats`` rounds, each calling every
    function once, after ``warmup`` untimed rounds. ``clock``: "wall" or "cpu" (see ``CLOCKS``)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r} is not known; use one of {sorted(CLOCKS)}")
    now = CLOCKS[clock]
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = now()
            fn()
            times[name].append(now() - start)
    return times


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def matmul_peak_flops(dtype: torch.dtype, size: int = 2048, repeats: int = 5, clock: str = "wall") -> float:
    """FLOP/s of a square ``size`` matmul in ``dtype`` (best of ``repeats``): this machine's
    practical peak, the yardstick for each variant's fraction of peak."""
    now = CLOCKS[clock]
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = now()
        torch.mm(a, b)
        best = min(best, now() - start)
    return 2 * size**3 / best
