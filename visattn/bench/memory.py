"""Peak memory of one call: on CPU from the kernel's resident-set high-water mark, on CUDA from the
caching allocator's peak.

torch has no allocator statistics on CPU (and tracemalloc does not see its buffers). So: return freed
heap pages to the OS (``malloc_trim``), reset the process's peak RSS (``/proc/self/clear_refs``,
Linux >= 4.0), run the call, and report ``VmHWM - VmRSS_before``: the memory the call itself touched
(activations, saved tensors, gradients, kernel workspaces), with model and inputs already resident.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_RESET_PEAK_RSS = "5"


def _status_kib(key: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _malloc_trim() -> None:
    name = ctypes.util.find_library("c")
    if name is not None:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):
            pass


def peak_memory_available() -> bool:
    try:
        _status_kib("VmHWM")
        _CLEAR_REFS.write_text(_RESET_PEAK_RSS)
    except (OSError, KeyError):
        return False
    return True


def call_peak_mb(fn: Callable[[], object], device: torch.device | None = None) -> float | None:
    """MiB of memory ``fn()`` added at its peak: resident memory on CPU (None where the peak cannot be
    reset), allocated device memory on CUDA."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base) / 2**20
    _malloc_trim()
    try:
        _CLEAR_REFS.write_text(_RESET_PEAK_RSS)
        base = _status_kib("VmRSS")
        fn()
        peak = _status_kib("VmHWM")
    except (OSError, KeyError):
        return None
    return max(0, peak - base) / 1024
