"""Time, count and size a set of workloads side by side (the core shared by both bench modes)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from visattn.utils.flops import count_flops

from .memory import call_peak_mb
from .timing import interleaved_times, matmul_peak_flops, median, paired_ratio, ratio_interval, synced
from .workload import DTYPES, Workload, autocast_for

log = logging.getLogger(__name__)


def _active_heads(module: torch.nn.Module) -> list[int] | None:
    from visattn.attention import active_heads

    active, total = active_heads(module)
    return [active, total] if total else None


def _peak_memory(work: Workload, dtype_name: str, train: bool) -> dict[str, float | None]:
    work.module.eval()
    with torch.no_grad(), autocast_for(dtype_name, work.device.type):
        peaks = {"infer_peak_mb": call_peak_mb(work.infer, work.device)}
    if train:
        work.module.train()
        peaks["train_peak_mb"] = call_peak_mb(functools.partial(work.train_step, dtype_name), work.device)
    return peaks


def _eager_flops(work: Workload, fn: Callable[[], object]) -> float:
    with work.eager():
        return count_flops(fn)


def _interval(label: str, reference: str, times: dict[str, list[float]]) -> list[float] | None:
    """The 95% interval of ``label``'s time ratio to ``reference`` (None for the reference itself)."""
    if label == reference or reference not in times:
        return None
    interval = ratio_interval(times[label], times[reference])
    return list(interval) if interval else None


def add_images_per_s(row: dict[str, Any], batch: int) -> dict[str, Any]:
    """``row`` with ``infer_images_per_s`` / ``train_images_per_s`` from its ``*_ms`` at ``batch``."""
    for mode in ("infer", "train"):
        if f"{mode}_ms" in row:
            row[f"{mode}_images_per_s"] = batch / (row[f"{mode}_ms"] / 1e3)
    return row


def measure_cases(
    cases: Mapping[str, tuple[Any, tuple]],
    build: Callable[..., Workload],
    dtypes: list[str],
    warmup: int,
    repeats: int,
    train: bool,
    memory: bool,
    reference: str | None = None,
    clock: str = "wall",
    device: torch.device | str = "cpu",
    compile: bool = False,
) -> list[dict[str, Any]]:
    """Rows for ``cases`` (label -> (case with a ``train`` flag, args of ``build``)), per dtype, each
    workload built, then moved to ``device`` (on CUDA every timed call ends with a synchronisation);
    ``compile``: time ``torch.compile``d forwards (the warm-up rounds compile; FLOPs are counted eagerly).

    ``reference`` (default: the first label) is the denominator of every ratio; all cases of a dtype
    are timed round-robin in the same rounds, and each ratio is the median of the per-round ratios
    (``timing.paired_ratio``), so drift of a shared machine cancels in it.
    ``clock``: "wall" or "cpu" (process CPU time; see ``timing.CLOCKS``).
    Row keys: label, dtype, infer_ms, infer_ratio, train_ms, train_ratio, infer_flops, train_flops,
    infer_peak_fraction, train_peak_fraction, infer_peak_mb, train_peak_mb, matmul_peak_gflops,
    active_heads, infer_samples_ms, train_samples_ms, infer_ratio_ci, train_ratio_ci (a 95% interval of
    the ratio, ``timing.ratio_interval``; None for the reference and with under 5 rounds); ``skipped``
    for a case that failed to build.
    """
    for name in dtypes:
        if name not in DTYPES:
            raise ValueError(f"dtype {name!r} is not known; use one of {sorted(DTYPES)}")
    device = torch.device(device)
    if device.type == "cuda" and clock == "cpu":
        raise ValueError("clock='cpu' times this process's CPU, not the GPU's work; use clock='wall' on CUDA")
    works: dict[str, Workload] = {}
    skipped: list[dict[str, Any]] = []
    for label, (_, args) in cases.items():
        try:
            works[label] = build(*args).to(device)
            if compile:
                works[label].compile()
        except (ValueError, TypeError, ImportError) as err:
            log.warning("skipping %s: %s", label, err)
            skipped.append({"label": label, "skipped": str(err)})
    if not works:
        return skipped
    reference = reference if reference in works else next(iter(works))
    trains = {label: w for label, w in works.items() if train and cases[label][0].train}

    rows = []
    for dtype_name in dtypes:
        mm_dtype = DTYPES[dtype_name] or torch.float32
        peak = matmul_peak_flops(mm_dtype, clock=clock, device=device)
        for w in works.values():
            w.module.eval()
        with torch.no_grad(), autocast_for(dtype_name, device.type):
            infers = {k: synced(device, w.infer) for k, w in works.items()}
            infer_times = interleaved_times(infers, warmup, repeats, clock)
            infer_flops = {k: _eager_flops(w, w.infer) for k, w in works.items()}
        train_times, train_flops = {}, {}
        if trains:
            for w in trains.values():
                w.module.train()
            steps = {k: functools.partial(w.train_step, dtype_name) for k, w in trains.items()}
            train_times = interleaved_times({k: synced(device, s) for k, s in steps.items()}, warmup, repeats, clock)
            train_flops = {k: _eager_flops(trains[k], step) for k, step in steps.items()}
        peak = max(
            peak, matmul_peak_flops(mm_dtype, clock=clock, device=device)
        )  # the better of before and after: the machine's peak

        for label, w in works.items():
            row: dict[str, Any] = {
                "label": label,
                "dtype": dtype_name,
                "active_heads": _active_heads(w.module),
                "matmul_peak_gflops": peak / 1e9,
            }
            t = median(infer_times[label])
            row.update(
                infer_ms=1e3 * t,
                infer_ratio=paired_ratio(infer_times[label], infer_times[reference]),
                infer_ratio_ci=_interval(label, reference, infer_times),
                infer_flops=infer_flops[label],
                infer_peak_fraction=infer_flops[label] / t / peak,
                infer_samples_ms=[1e3 * s for s in infer_times[label]],
            )
            if label in train_times:
                t = median(train_times[label])
                row.update(
                    train_ms=1e3 * t,
                    train_ratio=paired_ratio(train_times[label], train_times[reference])
                    if reference in train_times else None,
                    train_ratio_ci=_interval(label, reference, train_times),
                    train_flops=train_flops[label],
                    train_peak_fraction=train_flops[label] / t / peak,
                    train_samples_ms=[1e3 * s for s in train_times[label]],
                )
            if memory:
                row.update(_peak_memory(w, dtype_name, label in trains))
            rows.append(row)
    for w in works.values():
        w.module.eval()
    return rows + skipped
