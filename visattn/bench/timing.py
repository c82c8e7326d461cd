"""Wall-clock timing: interleaved medians (machine drift hits every variant alike) and the
machine's matmul peak measured in the same process."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from visattn.utils.ratios import median_ratio

CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    # CPU seconds of this process: on a machine shared with other jobs, time spent waiting for a
    # core is not counted (with one thread, the closest to an idle machine's wall time)
    "cpu": time.process_time,
}


def interleaved_times(
    fns: Mapping[str, Callable[[], object]], warmup: int = 2, repeats: int = 10, clock: str = "wall", seed: int = 0
) -> dict[str, list[float]]:
    """Seconds per call of each function, sampled in rounds: ``repeats`` rounds, each calling every
    function once, after ``warmup`` untimed rounds. ``clock``: "wall" or "cpu" (see ``CLOCKS``).

    Each timed round calls the functions in a new order (a permutation drawn from ``seed``: the same
    orders in every run). In a fixed order a function always ran right after the same one, and what
    ran before mattered: in bf16 a masked dense MoH layer ran 9-10% slower right after a path that
    allocates much (a PyTorch fallback) than right after ``mha`` (ViT-S shapes, Intel Xeon;
    ``csrc/session7/position2.py`` on the local branch ``proto/moh-kernels``), a bias in its ratio
    that no number of rounds removed. Shuffled, the predecessor varies and the median sees each."""
    if clock not in CLOCKS:
        raise ValueError(f"clock={clock!r} is not known; use one of {sorted(CLOCKS)}")
    now = CLOCKS[clock]
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    rng = random.Random(seed)
    for _ in range(repeats):
        rng.shuffle(order)
        for name in order:
            fn = fns[name]
            start = now()
            fn()
            times[name].append(now() - start)
    return times


def synced(device: torch.device, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` that returns only once the device has finished its work (CUDA runs asynchronously, so a
    clock read after an unsynchronised call times the launch, not the work); ``fn`` itself on CPU."""
    if device.type != "cuda":
        return fn

    def call():
        out = fn()
        torch.cuda.synchronize(device)
        return out

    return call


def median(samples: list[float]) -> float:
    return statistics.median(samples)


RATIO_CONFIDENCE = 0.95
RATIO_RESAMPLES = 4000
MIN_ROUNDS_FOR_INTERVAL = 5


def paired_ratio(samples: list[float], reference: list[float]) -> float:
    """The time ratio the benches report for two functions timed in the same rounds (``samples[i]`` and
    ``reference[i]`` in round i, as ``interleaved_times`` gives them): the median over rounds of
    ``samples[i] / reference[i]``.

    Each round's ratio cancels what the round shared: the machine's speed at that moment (a neighbour's
    load, the clock). The ratio of the two medians, reported until the 17th session, did not: the medians
    could come from rounds a slow spell separated, and on a 2-core EPYC whose timings drifted by +-30% its
    95% interval was +-15% where this one's was +-2% (same runs; docs/benchmarks.md)."""
    if len(samples) != len(reference) or not samples:
        raise ValueError(
            f"{len(samples)} samples against {len(reference)} reference samples: a paired ratio needs one of each "
            "per round (interleaved_times)"
        )
    return median_ratio(samples, reference)


def ratio_interval(
    samples: list[float], reference: list[float], confidence: float = RATIO_CONFIDENCE,
    resamples: int = RATIO_RESAMPLES, seed: int = 0,
) -> tuple[float, float] | None:
    """A bootstrap confidence interval of ``paired_ratio(samples, reference)``, the ratio the benches report,
    from two functions timed in the same rounds: the rounds are resampled whole. None with fewer than 5 rounds,
    or where the lists are not one per round. The interval says whether a measured ratio resolves a target."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be between 0 and 1, e.g. 0.95")
    n = len(samples)
    if n != len(reference) or n < MIN_ROUNDS_FOR_INTERVAL:
        return None
    rounds = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    ratios = np.median((np.asarray(samples) / np.asarray(reference))[rounds], axis=1)
    tail = (1 - confidence) / 2
    low, high = np.quantile(ratios, [tail, 1 - tail])
    return float(low), float(high)


def pooled_ratio(runs: list[tuple[list[float], list[float]]]) -> float:
    """The paired ratio of several runs of one comparison (``(samples, reference)`` per run, each timed in the
    same rounds as ``paired_ratio`` takes them): the median of every round's ratio, all runs' rounds pooled."""
    if not runs:
        raise ValueError("no runs to pool: give one (samples, reference) pair of lists per run")
    for samples, reference in runs:
        paired_ratio(samples, reference)  # refuses unpaired lists, naming their lengths
    return median_ratio([t for s, _ in runs for t in s], [t for _, r in runs for t in r])


def pooled_interval(
    runs: list[tuple[list[float], list[float]]], confidence: float = RATIO_CONFIDENCE,
    resamples: int = RATIO_RESAMPLES, seed: int = 0,
) -> tuple[float, float] | None:
    """A bootstrap interval of ``pooled_ratio(runs)`` that covers the change of the machine between runs as well
    as the noise within each: the runs are resampled, then each drawn run's rounds (two-level bootstrap). One
    run's ``ratio_interval`` cannot show the first: two runs a few minutes apart on one machine differed by more
    than either run's interval (docs/benchmarks.md, 17th session). None where a run has fewer than 5 rounds."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must be between 0 and 1, e.g. 0.95")
    pooled_ratio(runs)  # the same checks
    if any(len(s) < MIN_ROUNDS_FOR_INTERVAL for s, _ in runs):
        return None
    ratios = [np.asarray(s) / np.asarray(r) for s, r in runs]
    rng = np.random.default_rng(seed)
    medians = np.empty(resamples)
    for i in range(resamples):
        drawn = [ratios[j] for j in rng.integers(0, len(ratios), size=len(ratios))]
        medians[i] = np.median(np.concatenate([run[rng.integers(0, len(run), size=len(run))] for run in drawn]))
    tail = (1 - confidence) / 2
    low, high = np.quantile(medians, [tail, 1 - tail])
    return float(low), float(high)


PROBE_BUDGET_S = 0.05  # time the peak probe aims for, on any CPU or GPU
PROBE_START_SIZE = 64
PROBE_MAX_SIZE = 4096
PROBE_MAX_REPEATS = 20


def _mm_seconds(a: torch.Tensor, b: torch.Tensor, now: Callable[[], float]) -> float:
    """One ``F.linear(a, b)`` (a @ b.T), the kernel of every nn.Linear, where models spend most of their
    FLOPs. torch.mm takes another CPU path: on AVX2-only CPUs bf16 torch.mm ran 4-7x slower than bf16
    F.linear (oneDNN), so a torch.mm probe under-stated the peak and models reported > 100% of it."""
    start = now()
    F.linear(a, b)
    if a.is_cuda:
        torch.cuda.synchronize(a.device)
    return now() - start


def matmul_peak_flops(
    dtype: torch.dtype, budget_s: float = PROBE_BUDGET_S, clock: str = "wall", max_size: int = PROBE_MAX_SIZE,
    device: str | torch.device = "cpu",
) -> float:
    """FLOP/s of a square matmul in ``dtype`` (best of its repeats): this machine's practical peak,
    the yardstick for each variant's fraction of peak.

    Sized by time, not by a fixed shape: the side doubles from 64 until one product takes about half
    of ``budget_s`` (or reaches ``max_size``), then repeats fill the budget (at most 20). The probe
    costs a few ``budget_s`` on a fast matmul and on an emulated one (bf16 on AVX2-only CPUs runs
    ~20x slower than fp32) alike, instead of minutes for a fixed 2048^2 bf16 product. Each size is
    timed with ``F.linear`` (see ``_mm_seconds``).
    """
    if budget_s <= 0:
        raise ValueError(f"budget_s={budget_s} must be > 0 seconds")
    now = CLOCKS[clock]
    size = PROBE_START_SIZE
    while True:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        _mm_seconds(a, b, now)  # warm-up: first-call dispatch and allocation
        seconds = _mm_seconds(a, b, now)
        if seconds >= budget_s / 2 or size >= max_size:
            break
        size *= 2
    repeats = max(1, min(PROBE_MAX_REPEATS, int(budget_s / max(seconds, 1e-9))))
    best = min([seconds] + [_mm_seconds(a, b, now) for _ in range(repeats)])
    return 2 * size**3 / max(best, 1e-12)
