"""Keep glibc from returning large freed buffers to the OS.

With the defaults, every activation above the mmap threshold is mmap'ed and unmapped per call, so
big tensors page-fault on every step (it made a masked MoH ViT look 13-25% slower than it is).
The environment equivalent, for commands we do not start: MALLOC_MMAP_THRESHOLD_=33554432
MALLOC_TRIM_THRESHOLD_=17179869184.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int; the largest one keeps freed memory in the process


def tune_glibc_malloc() -> bool:
    """Raise glibc's mmap and trim thresholds in this process; False where glibc is absent or the
    environment already set them."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
        ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    except (OSError, AttributeError):
        return False
    if not ok:
        log.debug("mallopt refused the thresholds")
    return ok
