"""Softmax attention of small heads in the compiled kernel (``visattn/kernels/small_attention.cpp``), where the
running machine computes it faster than SDPA.

At the study's sizes (8-12 wide heads, 17-49 tokens, batch 256) SDPA's CPU kernel ran at 4.6-6.6 GFLOP/s on an
AMD EPYC core (Zen 3), half or more of an attention layer's time; the kernel took 0.62-0.68x its time there, and
1.1-1.45x at 64 keys 16-32 wide (docs/benchmarks.md, 21st session). Which is faster depends on the CPU, so the first eval call at a new
shape times both, interleaved, with the probe MoH's ``impl="auto"`` uses (``visattn.attention.impl_probe``:
SDPA is the reference, kept unless the kernel is clearly faster), an instance of its own (``PROBE``: MoH's probe
times this attention inside its paths, and a timer scripted for those paths in a test knows none of these), and
the choice is kept per process (and on disk where opted in). Float32, no mask, not causal, no dropout, at most
``MAX_KEYS`` keys and ``MAX_WIDTH`` wide heads, eager on a CPU; SDPA elsewhere.

Training takes the kernel and its backward (``SmallAttention``) only in a layer whose ``train_attention`` a run's
start-up probe set (``visattn.attention.train_paths``): the two differ in the last bits, so a run chooses once and
keeps the choice, as it does MoH's training paths. Forward and backward together ran in 0.52x SDPA's time at the
study classifier's and the study DiT's sizes (AMD EPYC Zen 3, 23rd session; docs/benchmarks.md).
"""

import torch
import torch.nn.functional as F

from visattn.kernels import build_id, small_attention_op

from .fused_gating import eager_cpu
from .impl_probe import ImplProbe, default_disk_dir, device_name
from .tracing import autocast_enabled

MAX_KEYS = 64  # the kernel keeps a row of scores in 8 vector registers
MAX_WIDTH = 32
REFERENCE = "sdpa"
KERNEL = "small_attention"
PROBE = ImplProbe(disk_dir=default_disk_dir())


@torch.jit.unused  # TorchScript runs SDPA
def small_attention_runs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
    dropout_p: float,
) -> bool:
    """Whether ``small_attention`` may replace SDPA for these arguments (q: [B, H, N, d], k / v: [B, Hkv, M, d]):
    nothing to differentiate (``small_attention_fits`` with gradients)."""
    if not small_attention_fits(q, k, v, attn_mask, is_causal, dropout_p):  # first: it says no to an fx Proxy
        return False
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


@torch.jit.unused
def small_attention_fits(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
    dropout_p: float,
) -> bool:
    """Whether the kernel (built, and switched on) computes what SDPA would for these arguments, with or without
    gradients."""
    if attn_mask is not None or is_causal or dropout_p != 0.0 or not eager_cpu(q):
        return False
    if any(t.dtype != torch.float32 or t.dim() != 4 or t.stride(-1) != 1 for t in (q, k, v)):
        return False
    H, d, Hkv, M = q.shape[1], q.shape[-1], k.shape[1], k.shape[-2]
    return (
        1 <= M <= MAX_KEYS and 1 <= d <= MAX_WIDTH and Hkv >= 1 and H % Hkv == 0 and not autocast_enabled("cpu")
        and small_attention_op() is not None
    )  # fmt: skip


@torch.jit.unused
def small_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, row_gates: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale) v, q: [B, H, N, d], k / v: [B, Hkv, M, d] -> [B, H, N, d], through the kernel or SDPA,
    whichever the probe found faster for these shapes. Call only where ``small_attention_runs``.

    ``row_gates`` [B, N, H] (MoH's head gates, float32): the kernel skips the query rows whose gate is 0 and writes
    0 there (the other rows are what they are without gates, bit for bit), so pass them only where the heads are
    then multiplied by these gates. The probe times both without gates (skipping only lightens the kernel's side,
    and one choice per shape keeps MHA and MoH layers of a shape on the same attention)."""
    return small_attention_gated(q, k, v, scale, row_gates, scale_rows=False)[0]


@torch.jit.unused
def small_attention_gated(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, row_gates: torch.Tensor | None,
    scale_rows: bool = True,
) -> tuple[torch.Tensor, bool]:
    """``small_attention``, and with ``scale_rows`` the kernel multiplies each output row by its gate as it writes
    it (the gated heads, equal bit for bit to that product taken after). -> (heads [B, H, N, d], whether they are
    gated: False where the probe chose SDPA, or without float32 gates; the caller then multiplies them)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    op = small_attention_op()
    gqa = q.shape[1] != k.shape[1]
    runs = {
        REFERENCE: lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa),
        KERNEL: lambda: op(q, k, v, scale),
    }
    device = device_name(q.device)
    key = (KERNEL, device, torch.get_num_threads(), torch.__version__, tuple(q.shape), tuple(k.shape), build_id())
    choice = PROBE.choose(key, runs, REFERENCE, tuple(q.shape), "float32", device)
    if choice.path == KERNEL and row_gates is not None and row_gates.dtype == torch.float32:
        return op(q, k, v, scale, row_gates, scale_rows), scale_rows
    return runs[choice.path](), False


class SmallAttention(torch.autograd.Function):
    """The kernel's attention with its backward (``small_attention_backward``): q [B, H, N, d], k / v [B, Hkv, M,
    d], float32, ``scale``, ``row_gates`` [B, N, H] or None (as ``small_attention``: the rows gated 0 are neither
    attended nor differentiated, so pass them only where the heads are then multiplied by these gates), and
    ``scale_rows``: each output row multiplied by its gate, which then gets a gradient (0 at the rows gated 0, where
    soft gates have none: not for straight-through gates) -> [B, H, N, d]. Once differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, row_gates, scale_rows: bool):
        ctx.save_for_backward(q, k, v, row_gates)
        ctx.scale, ctx.scale_rows = scale, scale_rows
        return small_attention_op()(q, k, v, scale, row_gates, scale_rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, row_gates = ctx.saved_tensors
        grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        dq, dk, dv, dgates = torch.ops.visattn.small_attention_backward(grad_out, q, k, v, ctx.scale, row_gates,
                                                                         ctx.scale_rows)
        return dq, dk, dv, None, dgates if ctx.scale_rows else None, None


@torch.jit.unused
def small_attention_train(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, row_gates: torch.Tensor | None = None,
    scale_rows: bool = False,
) -> tuple[torch.Tensor, bool]:
    """``SmallAttention`` (no probe: the layer's run chose it). Call only where ``small_attention_fits``.
    -> (heads [B, H, N, d], whether they are gated: ``scale_rows`` with float32 ``row_gates``)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if row_gates is not None and row_gates.dtype != torch.float32:
        row_gates = None
    scale_rows = scale_rows and row_gates is not None
    gates = row_gates if scale_rows or row_gates is None else row_gates.detach()
    return SmallAttention.apply(q, k, v, scale, gates, scale_rows), scale_rows
