"""Compiled CPU kernels, built on this machine on first use, with the PyTorch code as the fallback.

``moh_routing_op()`` is MoH's token-choice routing in one pass (``moh_routing.cpp``): ``HeadRouter``
uses it for the masked dense path without gradients, where the PyTorch formulation costs about 20
small operations a layer (half the routing's time at the study's sizes; docs/benchmarks.md).

The extension is compiled with the C++ toolchain torch's ``cpp_extension`` finds (g++ and ninja) into
``$VISATTN_KERNEL_DIR`` (default ``~/.cache/visattn/kernels``), once per source, torch version, Python
and processor architecture; processes starting together wait on one build (cpp_extension's lock). Without a
compiler, or with ``VISATTN_KERNELS=0``, every caller gets None and runs the PyTorch path, which
the tests check equal. ``python -m visattn.kernels`` builds it ahead (``make`` does at install).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import logging
import os
import platform
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from filelock import FileLock  # torch's own dependency, and the lock its cpp_extension takes

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("moh_routing.cpp")
# -fno-trapping-math lets the compiler vectorise the loops over tokens (their selects and float -> int
# conversions) without giving up IEEE results: NaN still propagates, unlike -ffast-math.
CFLAGS = ["-O3", "-fno-trapping-math"]
_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("visattn_kernels_off", default=False)


def kernel_dir() -> Path:
    return Path(os.environ.get("VISATTN_KERNEL_DIR", Path.home() / ".cache" / "visattn" / "kernels"))


def _build_name() -> str:
    """A name per source, flags, torch, Python and processor architecture: another version builds
    apart instead of loading a stale one (no -march: one build serves every x86-64 CPU)."""
    key = f"{SOURCE.read_bytes()!r}{CFLAGS}{torch.__version__}{sys.version_info[:2]}{platform.machine()}"
    return "visattn_moh_routing_" + hashlib.sha1(key.encode()).hexdigest()[:12]


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, every caller runs the PyTorch code (A/B comparisons; ``bench study
    --compare-kernels``)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def moh_routing_op() -> Callable | None:
    """``torch.ops.visattn.moh_gates`` (built and loaded once per process), or None where it cannot
    be built, with ``VISATTN_KERNELS=0`` and inside ``disabled()``."""
    return None if _OFF.get() else _load_moh_routing()


@functools.cache
def _load_moh_routing() -> Callable | None:
    if os.environ.get("VISATTN_KERNELS", "1") == "0":
        return None
    try:
        name = _build_name()
        build_dir = kernel_dir() / name
        built = build_dir / f"{name}.so"
        build_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(str(build_dir / "lock")):  # the lock cpp_extension builds under: wait for a build under way
            ready = built.is_file()
        if ready:
            torch.ops.load_library(str(built))  # milliseconds; cpp_extension.load's checks take seconds
        else:
            from torch.utils import cpp_extension

            cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, build_directory=str(build_dir),
                               is_python_module=False, verbose=False)
        return torch.ops.visattn.moh_gates
    except Exception as err:  # noqa: BLE001 - any build or load failure means: use the PyTorch path
        log.warning("MoH routing kernel unavailable (%s: %s); routing runs in PyTorch (same results, slower). "
                    "Set VISATTN_KERNELS=0 to skip the build.", type(err).__name__, str(err).splitlines()[0][:200])
        return None
