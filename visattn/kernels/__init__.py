"""Compiled kernels (CPU, and one Triton kernel for GPUs), built on this machine on first use, with the PyTorch code as the fallback.

- ``moh_routing_op()``: MoH's token-choice routing in one pass (``moh_routing.cpp``), with its backward
  and the gated head merge's, alone or with the output projection (``torch.ops.visattn.``
  ``moh_gates_backward``, ``moh_gated_merge[_backward]``, ``moh_gated_proj[_backward]``, the last with
  MKL's SGEMM; ``visattn.attention.fused_gating``). ``HeadRouter`` uses it in every
  mode, where the PyTorch formulation costs about 20 small operations a layer each way (half the
  routing's time at the study's sizes; docs/benchmarks.md). The same library holds head choice's
  selection (``moh_head_choice``) and the per-image head load (``moh_head_load``).
- ``moh_cuda_gates_op()``: the same token-choice gates on a GPU, one Triton kernel (``cuda_routing.py``),
  with a Triton backward for training (``fused_gating.RoutedGatesCuda``).
- ``moh_routed_heads_op(dtype, blas)``: the heads of a MoH layer per image, computing only the
  selected (token, head) pairs (``moh_routed_heads.cpp``; the ``routed_kernel`` paths of
  ``visattn.attention.moh``). With ``blas`` its GEMMs are MKL's, looked up in the running torch
  build (None for a dtype whose GEMM the build does not export); without, its own loops (float32). In
  float32 on a CPU with AVX-512, or AVX2 and FMA, the attention between them runs in ``fused_attention.h``'s
  loops (``torch.ops.visattn.moh_fused_attention(head_dim)`` says where), and with AVX-512 the GEMMs in
  ``row_gemm.h``'s.
- ``moh_routed_attention_op(dtype, head_dim)``: the chosen pairs' attention alone, for
  ``routed_kernel_dense``: float32, and bfloat16 on AMX tiles (``amx_attention.h``).
- ``moh_routed_proj_op(dtype, head_dim)``: the chosen pairs' output projection alone, bfloat16 on AMX
  tiles (``amx_projection.h``), for ``routed_kernel_grouped``.
- ``moh_router_logits_op()``: the linear routers' logits without gradients (a matmul of a few output
  columns, float32, in the loops of ``small_gemm``), where it beats ``F.linear`` on the running machine;
  ``moh_router_gates_op()``: those logits and ``moh_gates``' pass in one op, per block of tokens, for
  inference (``routing.router_gates``).
- ``small_attention_op()``: softmax attention for small heads and short sequences (float32;
  ``small_attention.cpp``), which ``HeadAttention.sdpa`` takes over SDPA's where a probe on the running
  machine finds it faster (``visattn.attention.small_heads``), with its backward (``small_attention_backward``)
  in training where a run's probe chose it (``visattn.attention.train_paths``); for MoH it skips the rows gated 0
  and multiplies the others by their gates (``HeadAttention.gated_sdpa``).

The extension is compiled with the C++ toolchain torch's ``cpp_extension`` finds (g++ and ninja) into
``$VISATTN_KERNEL_DIR`` (default ``~/.cache/visattn/kernels``), once per source, torch version, Python
and processor architecture; processes starting together wait on one build (a file lock). Without a
compiler, or with ``VISATTN_KERNELS=0``, every caller gets None and runs the PyTorch path, which
the tests check equal. ``python -m visattn.kernels`` builds it ahead (``make`` does at install).
With ``VISATTN_KERNELS_AVX2=1`` (``AVX2_ONLY_ENV``) the CPU kernels run what they run on a CPU without
AVX-512 (and so without AMX) on any CPU: their AVX2 paths and loops, tested on an AVX-512 machine too.
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
from filelock import FileLock  # torch's own dependency

log = logging.getLogger(__name__)

AVX2_ONLY_ENV = "VISATTN_KERNELS_AVX2"
SOURCES = [
    Path(__file__).with_name(name) for name in ("moh_routing.cpp", "moh_routed_heads.cpp", "small_attention.cpp")
]
HEADERS = [
    Path(__file__).with_name(name)
    for name in (
        "amx_attention.h", "amx_projection.h", "blas.h", "fused_attention.h", "router_logits.h", "row_gemm.h", "simd.h",
        "softmax.h",
    )
]
# -fno-trapping-math lets the compiler vectorise the loops over tokens (their selects and float -> int
# conversions) without giving up IEEE results: NaN still propagates, unlike -ffast-math. -fopenmp makes
# at::parallel_for parallel: ATen's header runs it on the calling thread alone where _OPENMP is not
# defined, so until the 10th session every kernel ran on one thread whatever torch.set_num_threads said
# (the libgomp it links is the one torch has loaded: the same soname).
CFLAGS = ("-O3", "-fno-trapping-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)
_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("visattn_kernels_off", default=False)


def kernel_dir() -> Path:
    """``$VISATTN_KERNEL_DIR``, or the user cache where it is unset or empty (an empty value once built the
    kernels into the working directory, the repository's root)."""
    return Path(os.environ.get("VISATTN_KERNEL_DIR") or Path.home() / ".cache" / "visattn" / "kernels").expanduser()


@functools.cache
def _build_name() -> str:
    """A name per source, flags, torch, Python and processor architecture: another version builds
    apart instead of loading a stale one (no -march: one build serves every x86-64 CPU)."""
    sources = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    key = f"{sources!r}{CFLAGS}{LDFLAGS}{torch.__version__}{sys.version_info[:2]}{platform.machine()}"
    return "visattn_kernels_" + hashlib.sha1(key.encode()).hexdigest()[:12]


def build_id() -> str | None:
    """The name of the kernels' build this process loaded (it changes with their source, flags and torch),
    or None where they are off or failed: what a cached measurement of them depends on."""
    if _OFF.get() or not _load():
        return None
    return _build_name() + ("+avx2" if os.environ.get(AVX2_ONLY_ENV) == "1" else "")


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
    return None if _OFF.get() or not _load() else torch.ops.visattn.moh_gates


def moh_cuda_gates_op() -> Callable | None:
    """``visattn.kernels.cuda_routing.moh_gates_cuda`` (MoH's token-choice gates on a GPU in one Triton kernel;
    ``moh_gates_backward_cuda`` is their backward) where Triton is installed, else None (also with
    ``VISATTN_KERNELS=0`` and inside ``disabled()``). Nothing is built ahead: Triton compiles it on the GPU at first use."""
    if _OFF.get() or os.environ.get("VISATTN_KERNELS", "1") == "0":
        return None
    from . import cuda_routing

    return cuda_routing.moh_gates_cuda if cuda_routing.available() else None


def moh_routed_heads_op(dtype: torch.dtype, blas: bool = True) -> Callable | None:
    """``torch.ops.visattn.moh_routed_heads`` where it can run ``dtype`` inputs on this build, else None
    (as ``moh_routing_op``; with ``blas``, also where torch does not export MKL's GEMM for ``dtype``;
    without, for any dtype but float32)."""
    if _OFF.get() or not _load():
        return None
    if not blas:
        return torch.ops.visattn.moh_routed_heads if dtype == torch.float32 else None
    ok = dtype in (torch.float32, torch.bfloat16) and _has_blas(dtype)
    return torch.ops.visattn.moh_routed_heads if ok else None


def moh_routed_attention_op(dtype: torch.dtype, head_dim: int | None = None) -> Callable | None:
    """``torch.ops.visattn.moh_routed_attention`` (the attention of the chosen pairs, for callers that
    project densely) where it can run ``dtype`` inputs: float32 with MKL's SGEMM, any head width;
    bfloat16 on AMX tiles for heads ``head_dim`` wide where ``moh_amx_attention`` says they run (64 wide,
    a CPU with AMX); else None (as ``moh_routing_op``)."""
    if _OFF.get() or not _load():
        return None
    if dtype == torch.float32:
        return torch.ops.visattn.moh_routed_attention if _has_blas(dtype) else None
    if dtype == torch.bfloat16 and head_dim is not None and torch.ops.visattn.moh_amx_attention(head_dim):
        return torch.ops.visattn.moh_routed_attention
    return None


def moh_routed_proj_op(dtype: torch.dtype, head_dim: int) -> Callable | None:
    """``torch.ops.visattn.moh_routed_proj`` (the output projection of the chosen pairs alone, on AMX tiles,
    ``amx_projection.h``) where it runs ``dtype`` inputs: bfloat16, heads ``head_dim`` wide, where
    ``moh_amx_attention`` says the tiles run; else None (as ``moh_routing_op``)."""
    if _OFF.get() or not _load():
        return None
    ok = dtype == torch.bfloat16 and torch.ops.visattn.moh_amx_attention(head_dim)
    return torch.ops.visattn.moh_routed_proj if ok else None


def moh_router_logits_op() -> Callable | None:
    """``torch.ops.visattn.moh_router_logits`` (x [T, C] @ w^T for a router's few rows w [R, C], float32, in the
    kernels' own loops: ``HeadRouter`` times it against ``F.linear`` per shape) where the kernels load, else None
    (as ``moh_routing_op``)."""
    return None if _OFF.get() or not _load() else torch.ops.visattn.moh_router_logits


def moh_router_gates_op() -> Callable | None:
    """``torch.ops.visattn.moh_router_gates`` (MoH inference's routing from the tokens: the linear routers' logits
    in ``moh_router_logits``' loops per block of tokens, then ``moh_gates``' pass, and the head load; no backward)
    where the kernels load, else None (as ``moh_routing_op``)."""
    return None if _OFF.get() or not _load() else torch.ops.visattn.moh_router_gates


def small_attention_op() -> Callable | None:
    """``torch.ops.visattn.small_attention`` (q [B, H, N, d], k / v [B, Hkv, M, d], float32, M <= 64 keys, d <= 32
    wide -> the attention, [B, H, N, d] over a [B, N, H, d] buffer; its backward is
    ``torch.ops.visattn.small_attention_backward``) where the kernels load, else None (as ``moh_routing_op``)."""
    return None if _OFF.get() or not _load() else torch.ops.visattn.small_attention


def autocast_weight_op() -> Callable | None:
    """``torch.ops.visattn.autocast_weight`` (a float32 parameter as CPU autocast casts it, from autocast's
    own cache: ``visattn.attention.sparse.param_slice``) where the kernels load, else None."""
    return None if _OFF.get() or not _load() else torch.ops.visattn.autocast_weight


def has_sgemm() -> bool:
    """Whether the kernels that call MKL's SGEMM run here (``moh_gated_proj``, ``routed_kernel``): the
    kernels built and on, and the running torch build exports SGEMM."""
    return not _OFF.get() and _load() and _has_blas(torch.float32)


@functools.cache
def _has_blas(dtype: torch.dtype) -> bool:
    return bool(torch.ops.visattn.moh_routed_blas(dtype))


@functools.cache
def _load() -> bool:
    """Build (or find) and load the kernels' library once per process; False where that fails."""
    if os.environ.get("VISATTN_KERNELS", "1") == "0":
        return False
    try:
        name = _build_name()
        build_dir = kernel_dir() / name
        built = build_dir / f"{name}.so"
        build_dir.mkdir(parents=True, exist_ok=True)
        # Our own lock around the check and the build, so processes starting together build once. Not the
        # "lock" path cpp_extension locks: torch up to 2.11 takes that one as a baton (created exclusively, then
        # waited on until removed), which a lock file left there by filelock, or by a build killed midway,
        # blocks forever (every process on a fresh GPU machine hung so).
        with FileLock(str(build_dir / "visattn.lock")):
            if built.is_file():
                torch.ops.load_library(str(built))  # milliseconds; cpp_extension.load's checks take seconds
            else:
                from torch.utils import cpp_extension

                (build_dir / "lock").unlink(missing_ok=True)  # stale: every build runs under our lock
                # copies: cpp_extension appends to the lists it is given, which would change _build_name
                cpp_extension.load(name=name, sources=[str(source) for source in SOURCES],
                                   extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                                   build_directory=str(build_dir), is_python_module=False, verbose=False)
        return True
    except Exception as err:  # noqa: BLE001 - any build or load failure means: use the PyTorch path
        log.warning("MoH kernels unavailable (%s: %s); MoH runs its PyTorch code (same results, slower). "
                    "Set VISATTN_KERNELS=0 to skip the build.", type(err).__name__, str(err).splitlines()[0][:200])
        return False
