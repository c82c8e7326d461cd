"""What every run reports: ``results.json`` (atomic), parameter and FLOP counts, memory, throughput."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from visattn.utils.checkpoint import atomic_write_bytes
from visattn.utils.flops import count_flops

RESULTS_FILE = "results.json"


def _to_json(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _finite(obj: Any) -> Any:
    """NaN / inf -> None, so the file stays strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: str | Path, data: Any) -> None:
    text = json.dumps(_finite(json.loads(json.dumps(data, default=_to_json))), indent=2, sort_keys=False)
    atomic_write_bytes(path, (text + "\n").encode())


def write_results(run_dir: str | Path, results: Mapping[str, Any]) -> Path:
    """Write ``results.json`` in ``run_dir`` atomically; returns its path."""
    path = Path(run_dir) / RESULTS_FILE
    write_json(path, dict(results))
    return path


def count_params(model: nn.Module) -> int:
    """Every parameter, trained or fixed (e.g. DiT's sin-cos ``pos_embed``)."""
    return sum(p.numel() for p in model.parameters())


class RunClock:
    """Wall and CPU time of a run: this process since construction plus the earlier processes that
    trained it (their totals come back from a checkpoint through ``load_state_dict``).

    ``cpu_share`` (CPU seconds over wall seconds x torch threads, on CPU) tells whether the run had its
    cores: below about 0.9 in a run without data-loader workers, it shared them, and its measured
    throughput reads low. After resuming from a checkpoint that did not keep the totals, all three are
    None: the time of a part of the run is not passed off as the whole.
    """

    def __init__(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        self.earlier = {"wall": 0.0, "cpu": 0.0, "thread_seconds": 0.0}  # the processes before this one
        self.complete = True

    def state_dict(self) -> dict[str, float]:
        """The totals so far, this process included (what a checkpoint keeps)."""
        wall, cpu = time.perf_counter() - self.wall0, time.process_time() - self.cpu0
        return {"wall": self.earlier["wall"] + wall, "cpu": self.earlier["cpu"] + cpu,
                "thread_seconds": self.earlier["thread_seconds"] + wall * torch.get_num_threads()}

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        """Count the earlier processes' ``state_dict()``; None (a checkpoint that predates it) marks
        the totals incomplete."""
        self.complete = state is not None
        self.earlier = {key: float((state or {}).get(key, 0.0)) for key in self.earlier}

    def record(self, device: torch.device | str | None = None) -> dict[str, float | None]:
        if not self.complete:
            return {"wall_time_s": None, "cpu_time_s": None, "cpu_share": None}
        total = self.state_dict()
        on_cpu = device is None or torch.device(device).type == "cpu"
        share = total["cpu"] / total["thread_seconds"] if on_cpu and total["thread_seconds"] > 0 else None
        return {"wall_time_s": total["wall"], "cpu_time_s": total["cpu"], "cpu_share": share}


def peak_memory_mb(device: torch.device | str | None = None) -> float:
    """Peak memory of this process: CUDA allocator peak on a CUDA device, else the peak RSS."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def model_flops(model: nn.Module, *inputs: torch.Tensor) -> float:
    """Inference FLOPs of ``model(*inputs)`` (eval mode, so MoH counts its sparse path)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return float(count_flops(model, *inputs))
    finally:
        model.train(was_training)


class Throughput:
    """Items per second over the timed spans: ``start()`` ... ``stop(n_items)``, repeatable.

    Synchronises CUDA at both ends so the span covers the queued work; a span may hold many steps,
    so a loop can time without a sync per step.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.items = 0
        self.seconds = 0.0
        self.complete = True  # False after resuming from a checkpoint that did not keep the counts
        self._t0: float | None = None
        self._lap = (0, 0.0)  # items and seconds at the last lap()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def stop(self, items: int) -> None:
        if self._t0 is None:
            raise RuntimeError("Throughput.stop() called before start()")
        self._sync()
        self.seconds += time.perf_counter() - self._t0
        self.items += items
        self._t0 = None

    @property
    def running(self) -> bool:
        return self._t0 is not None

    @property
    def rate(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else 0.0

    def lap(self) -> float:
        """Items per second over the spans since the previous ``lap()`` (or the start): a log row's rate,
        which the whole run's ``rate`` hides once a slow start (compilation, warm-up) is in it."""
        items, seconds = self.items - self._lap[0], self.seconds - self._lap[1]
        self._lap = (self.items, self.seconds)
        return items / seconds if seconds > 0 else 0.0

    def add(self, items: int, seconds: float) -> None:
        """Count a span timed elsewhere (e.g. an epoch's) into this total."""
        self.items += items
        self.seconds += seconds

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps, so a resumed run reports the rate over all of its training."""
        return {"items": float(self.items), "seconds": self.seconds}

    @property
    def overall_rate(self) -> float | None:
        """``rate`` when every timed span of the run is counted; None after resuming from a checkpoint
        that did not keep the counts (a part of the run's rate is not passed off as the whole)."""
        return self.rate if self.complete else None

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        """Continue from ``state_dict()``; None (a checkpoint that predates it): counts from zero, and
        the total is marked incomplete."""
        self.complete = state is not None
        state = state or {}
        self.items, self.seconds = int(state.get("items", 0)), float(state.get("seconds", 0.0))
        self._lap = (self.items, self.seconds)  # a resumed run's first lap starts at the resume
