"""The compiled paths of MoH (``visattn/kernels/moh_routed_heads.cpp``), for token and head choice.

Same work as ``sparse_projections`` (``visattn.attention.sparse``): keys and values for every token, and
for each head only the queries, attention and output projection of the tokens that chose it (the
kernel reads the selection, whichever routing made it). The
PyTorch version pays per routed head for index tensors, gathers, a zero-padded SDPA call and a narrow
matmul, and sums the rows with an ``embedding_bag``; at these sizes that costs more than the skipped
work. The kernel runs the heads per image in C++ (gather, q GEMM, attention, gate, W_O GEMM, add into
the image's output rows), so the output stays in cache and nothing is padded.

- ``routed_kernel``: the routed heads in the kernel; the shared heads' queries and output projection in
  PyTorch (one matmul each for all tokens), their attention in SDPA or the kernel (below). Suits ViT-S / DiT-B sizes. In
  float32 the shared queries, the keys and values and the router's logits come from one matmul.
- ``routed_kernel_loops`` (float32): every head in the kernel. Its query and output projections are
  whole-tensor matmuls over every (token, head) pair, zeros where a pair is off; its attention runs the
  chosen pairs per image in its own loops (``small_gemm``). At the study's sizes (12-wide heads, 17-49
  tokens) a BLAS or SDPA call per image and head costs more than its work, and the projections per image
  and head (17 rows each) ran slower than ATen's matmuls over all rows even where half the pairs are off.
  With gradients it runs the kernel's backward too (``_HeadsLoops``), which recomputes each head's
  attention and takes the projections' gradients as whole-tensor matmuls as well.
- ``routed_kernel_dense`` (float32): the queries, keys and values of every (token, head) pair from one
  matmul, the chosen pairs' attention in the kernel (``moh_routed_attention``: per image and head, the
  chosen tokens' queries gathered, d values a row), the gated outputs in a [tokens, heads x width]
  buffer, zero where a pair is off, and one output matmul: "dense projections with skipped attention".
  It computes the projections of the pairs that are off too, yet where most routed pairs are on it ran
  faster than ``routed_kernel``'s per-head GEMMs and gathers (whose narrow 64-column GEMMs ran at half
  the wide matmul's speed per FLOP): ViT-S at 75% and DiT-B/2 at 90% of the heads (10th session).
- ``routed_kernel_grouped`` (bfloat16 on AMX): ``routed_kernel_dense`` with an output projection of the
  chosen pairs alone (``visattn/kernels/amx_projection.h``): the tokens that chose the same routed heads
  form a group, and each group's rows multiply only its heads' columns of W_O, on tiles. It took
  0.65-0.69x the dense output matmul's time at DiT-B/2 with 6 of 12 heads, 0.83-0.85x with 10 of 12, but
  1.10-1.18x at ViT-S with 5 of 6 (13th session), so ``auto`` times it beside ``routed_kernel_dense``.
  Elsewhere it is ``routed_kernel_dense``.
- ``masked_kernel_loops`` (float32): the masked dense computation in the loops kernel: the attention of
  every pair, unselected pairs zeroed by their gates. Until the projections became whole-tensor matmuls
  (9th session) it was the faster of the two where most routed heads are on; since then
  ``routed_kernel_loops`` was as fast or faster at every shape measured (docs/benchmarks.md). Where the
  kernel cannot run it is ``masked_dense``.

In float32 and for heads 16-64 wide, the kernel calls MKL less:
- on a CPU with AVX-512 (11th session), or AVX2 and FMA (27th), the attention of ``routed_kernel`` and
  ``routed_kernel_dense`` runs in loops of its own (``visattn/kernels/fused_attention.h``: scores, softmax
  and values per tile of 32 queries (AVX2: 16) in registers and L1, the next head's rows prefetched): on an
  AVX-512 Xeon 0.80-0.88x the time of MKL's two GEMMs per image and head, which ran as fast as SDPA does; on
  an AVX2 EPYC (Zen 3) 0.89-0.94x, and 0.89-0.93x SDPA's. ``routed_kernel``'s shared heads take it too,
  instead of SDPA;
- with AVX-512, ``routed_kernel``'s per-head projections read x's chosen rows in place and add the heads'
  outputs into their rows in the same pass (``row_gemm.h``): 105-139 GFLOP/s against 81-91 for MKL's GEMMs
  with the row copies around them.
Elsewhere it is MKL's GEMMs and SDPA. In bfloat16, ``routed_kernel_dense``'s attention runs on AMX tiles
where the CPU has them (``visattn/kernels/amx_attention.h``, heads 64 wide): there SDPA's bf16 attention
is half or more of an MHA layer's time, as the AMX matmuls are so fast; elsewhere bfloat16
``routed_kernel_dense`` is ``dense_projections``.

``impl="auto"`` times them where they run. Where the kernel cannot run (gradients for ``routed_kernel``
and ``routed_kernel_dense``, dropout in training, a device other than the CPU, a dtype it does not
serve, no C++ toolchain, ``VISATTN_KERNELS=0``), the first two are ``sparse_projections`` (head choice:
``head_gather``) and ``routed_kernel_dense`` is ``dense_projections``: the same computations in PyTorch;
the tests hold them equal. So it is under a Python dispatch mode (the FLOP counter, debug modes): the
mode then sees every operation, and the executed FLOPs counted for these paths are the PyTorch path's
(the same pairs; ``sparse_projections``' grouped attention also computes the padding rows).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from visattn.kernels import moh_routed_attention_op, moh_routed_heads_op, moh_routed_proj_op

from .base import HeadAttention
from .fused_gating import functorch_active, needs_grad
from .head_gather import head_gather_forward
from .sparse import (
    _Rows,
    _shared_heads,
    cast_param,
    compute_dtype,
    linear_rows,
    matmul_param,
    sparse_moh_forward,
)

MASKED_KERNEL_PATH = "masked_kernel_loops"
DENSE_KERNEL_PATH = "routed_kernel_dense"
GROUPED_KERNEL_PATH = "routed_kernel_grouped"
KERNEL_PATHS = ("routed_kernel", "routed_kernel_loops", MASKED_KERNEL_PATH, DENSE_KERNEL_PATH, GROUPED_KERNEL_PATH)
# impl="sparse" takes routed_kernel_loops up to this many query weights per head (dim x head width):
# the study's layers (96 x 12, 64 x 8) ran faster on the loops, ViT-S (384 x 64) and DiT-B (768 x 64)
# on MKL (docs/benchmarks.md). impl="auto" measures instead.
LOOPS_MAX_WEIGHTS = 16384


def routed_kernel_supported(attn: HeadAttention) -> str | None:
    """None when ``attn``'s routing suits the kernel (the linear router, no query norm), else why not.
    Whether it runs also depends on the input (``kernel_runs``). The kernel reads a selection, so head
    choice suits it as token choice does. A dense layer (``routed_topk=0``: every head on, soft weights)
    suits ``routed_kernel_loops`` only: nothing is skipped, but its loops compute the study's small
    heads faster than SDPA does."""
    router = attn.router
    if router is None:
        return "the layer does not route heads"
    if router.router_kind != "linear":
        return "the l2norm router scores the queries, which the kernel computes itself"
    if not isinstance(attn.q_norm, torch.nn.Identity):
        return "qk_norm normalises the routed queries, which the kernel does not"
    return None


def uses_loops(path: str) -> bool:
    """Whether kernel path ``path`` runs the kernel's own loops (float32, with a backward)."""
    return path not in ("routed_kernel", DENSE_KERNEL_PATH, GROUPED_KERNEL_PATH)


def preferred_kernel_path(attn: HeadAttention) -> str:
    """The kernel path ``impl="sparse"`` takes for this layer's size."""
    return "routed_kernel_loops" if attn.dim * attn.head_dim <= LOOPS_MAX_WEIGHTS else "routed_kernel"


def kernel_runs(attn: HeadAttention, x: torch.Tensor, loops: bool = False) -> bool:
    """Whether ``routed_kernel_forward(attn, x, loops)`` runs the kernel (else its PyTorch equivalent),
    outside dispatch modes. With gradients only the loops have a backward (``_HeadsLoops``)."""
    return _cpu_eager(attn, x, backward=loops) and moh_routed_heads_op(compute_dtype(x), blas=not loops) is not None


def kernel_path_runs(attn: HeadAttention, x: torch.Tensor, path: str) -> bool:
    """Whether kernel path ``path`` runs its kernel for x (else its PyTorch equivalent), outside dispatch
    modes."""
    if path == GROUPED_KERNEL_PATH:
        return kernel_path_runs(attn, x, DENSE_KERNEL_PATH) and grouped_projection_runs(attn, compute_dtype(x))
    if path == DENSE_KERNEL_PATH:
        return (_cpu_eager(attn, x, backward=False)
                and moh_routed_attention_op(compute_dtype(x), attn.head_dim) is not None)
    return kernel_runs(attn, x, uses_loops(path))


def grouped_projection_runs(attn: HeadAttention, dtype: torch.dtype) -> bool:
    """Whether ``moh_routed_proj`` can take ``attn``'s output projection in ``dtype`` here: bfloat16 on AMX
    tiles, heads 64 wide, outputs a multiple of 32 wide, at most 64 routed heads."""
    return (moh_routed_proj_op(dtype, attn.head_dim) is not None and attn.proj.out_features % 32 == 0
            and attn.num_heads - attn.router.shared_heads <= 64)


def _cpu_eager(attn: HeadAttention, x: torch.Tensor, backward: bool) -> bool:
    """A plain CPU tensor outside functorch, no dropout in training, and gradients only where the path
    has a ``backward``."""
    return (
        x.device.type == "cpu"
        and (backward or not needs_grad(attn, x))
        and not (attn.training and attn.attn_drop.p > 0)
        and type(x) is torch.Tensor
        and not functorch_active()
    )


def routed_kernel_forward(
    attn: HeadAttention, x: torch.Tensor, loops: bool = False, every_head: bool = False
) -> torch.Tensor:
    """x: [B, N, C] -> [B, N, dim_out], the output of ``attn.forward(x)`` (no mask, not causal) through
    ``routed_kernel`` (or ``routed_kernel_loops`` with ``loops``; ``masked_kernel_loops`` with
    ``every_head`` too). Call only when ``routed_kernel_supported(attn)`` is None."""
    if not kernel_runs(attn, x, loops) or _get_current_dispatch_mode() is not None:
        return _same_in_pytorch(attn, x, every_head)
    dtype = compute_dtype(x)
    op = moh_routed_heads_op(dtype, blas=not loops)
    B, N, C = x.shape
    T = B * N
    H, d, Hkv = attn.num_heads, attn.head_dim, attn.num_kv_heads
    x = x.to(dtype).contiguous()

    shared = H if every_head else attn.router.shared_heads
    first_head = 0 if loops else shared  # the heads before it run in PyTorch (_shared_heads)
    kv_w, kv_b = linear_rows(attn.qkv, attn.attn_dim, attn.attn_dim + 2 * attn.kv_dim, dtype)
    logits = q_shared = v_bias = None
    if attn.router_columns and dtype == torch.float32:
        # One matmul for the shared heads' queries, the keys and values, and the router's logits: at
        # ViT-S / DiT-B/2 sizes the router's own 7-12 column matmul took 1.3-1.5 ms and its 16 columns
        # appended 0.1-0.7; the shared queries' own matmul 3.3 / 8.3 ms and appended 1.6 / 6.3
        # (docs/benchmarks.md, 9th session). In bf16 16 columns would misalign the rows (the 8th
        # session's finding), so bf16 keeps the separate matmuls.
        q_w, q_b = linear_rows(attn.qkv, 0, first_head * attn.head_dim, dtype)
        bias = torch.cat([q_b, kv_b]) if kv_b is not None else None  # both rows of qkv's bias, or neither
        if bias is not None and _bias_after_matmul(attn, x):
            bias, v_bias = None, kv_b[attn.kv_dim :]
        (q_shared, k, v), logits = attn.linear_with_logits(
            x, [q_w, kv_w], bias, [first_head * attn.head_dim, attn.kv_dim, attn.kv_dim]
        )
        if v_bias is not None and first_head:
            q_shared.add_(q_b)  # a view of the matmul's output; no autograd here
    else:
        k, v = torch.nn.functional.linear(x, kv_w, kv_b).split(attn.kv_dim, dim=-1)
    k = attn.k_norm(k.view(B, N, Hkv, d).transpose(1, 2)).to(dtype)  # [B, Hkv, N, d]
    v = v.view(B, N, Hkv, d).transpose(1, 2)
    if every_head:  # every head as the kernel runs shared ones; the gates are 0 where a head is off
        gates, _ = attn.route(x, None, selection=False, logits=logits)  # [B, N, H]
        routed_mask = x.new_zeros((0, T), dtype=torch.bool)
    else:
        gates, selected = attn.route(x, None, logits=logits)  # [B, N, H] each
        routed_mask = _routed_mask(selected, shared)

    if loops and needs_grad(attn, x):
        wq = attn.qkv.weight[: attn.attn_dim]
        bq = attn.qkv.bias[: attn.attn_dim] if attn.qkv.bias is not None else None
        out = _HeadsLoops.apply(op, x.view(T, C), wq, bq, attn.proj.weight, k, v, routed_mask, gates.view(T, H), shared)
        if attn.proj.bias is not None:
            out = out + attn.proj.bias
        return attn.proj_drop(out.view(B, N, -1))
    out = _Rows(T, attn.proj.out_features, x, [])
    out_bias = None
    if first_head:
        if dtype == torch.float32:
            # the kernel adds the bias to each image's rows while they are in cache: the shared heads'
            # addmm would first copy it into every row (~1 ms at ViT-S, 10th session)
            out_bias = attn.proj.bias
        if dtype != torch.float32 or not _shared_heads_fused(out, attn, q_shared, k, v, v_bias, gates, shared):
            _shared_heads(out, attn, x, k, v, gates, shared, H // Hkv, 0.0, q_shared, v_bias, out_bias is None)
        rows = out.result()  # [T, dim_out]
    else:
        bias = attn.proj.bias
        rows = out.buffer.zero_() if bias is None else out.buffer.copy_(bias.to(dtype).expand_as(out.buffer))
    qkv_b = attn.qkv.bias.to(dtype) if attn.qkv.bias is not None else None
    # the whole weights in dtype, under autocast its own casts (kept for the region): cast here on every
    # call, they had cost 1.8 ms a bf16 DiT-B/2 layer (13th session)
    qkv_w, proj_w = cast_param(attn.qkv.weight, dtype), cast_param(attn.proj.weight, dtype)
    op(x.view(T, C), qkv_w, qkv_b, proj_w, k, v, v_bias, routed_mask, gates.view(T, H), shared, first_head, loops,
       rows, out_bias)
    return attn.proj_drop(rows.view(B, N, -1))


def _shared_heads_fused(
    out: _Rows, attn: HeadAttention, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
    v_bias: torch.Tensor | None, gates: torch.Tensor, shared: int,
) -> bool:
    """``_shared_heads`` with the attention in the kernel's fused loops (``moh_routed_attention``, every
    head shared) instead of SDPA, where they run (float32 on a CPU with AVX-512, or AVX2 and FMA, heads
    16-64 wide, the shared queries from the one matmul with their bias, whole groups of key/value heads):
    on an AVX-512 Xeon they took 0.80-0.88x the time of MKL's GEMMs, which ran as fast as SDPA (11th
    session); on an AVX2 EPYC 0.89-0.93x SDPA's time (27th). False where it did
    nothing. q: [B, N, shared * d] (a view of the matmul's output; the heads' outputs overwrite it), k/v:
    [B, Hkv, N, d], v_bias: the values' bias [Hkv * d] when v came without it, gates: [B, N, H]; appends
    [B * N, dim_out] rows to ``out``, without the output's bias (in float32 the kernel adds it)."""
    d, group = attn.head_dim, attn.num_heads // attn.num_kv_heads
    op = moh_routed_attention_op(torch.float32)
    if q is None or op is None or shared % group or not torch.ops.visattn.moh_fused_attention(d):
        return False
    B, N, _ = q.shape
    T, kv_heads = B * N, shared // group
    z = q.reshape(T, -1)  # the heads' outputs over their queries, as in routed_dense_forward
    no_routed = torch.zeros(0, T, dtype=torch.bool)
    head_gates = gates.reshape(T, -1)[:, :shared].contiguous()
    bias = v_bias[: kv_heads * d] if v_bias is not None else None
    op(z, None, k[:, :kv_heads], v[:, :kv_heads], bias, no_routed, head_gates, shared, 0, z)
    out.linear(z, attn.proj.weight[:, : shared * d], None)
    return True


def _bias_after_matmul(attn: HeadAttention, x: torch.Tensor) -> bool:
    """Whether the keys and values may come from a matmul without qkv's bias (inference, float32).

    An addmm first copies its bias into every output row: on the [tokens, 800-1900] keys-and-values
    matmul at ViT-S / DiT-B/2 sizes that took 1.7-2.9 ms, 6-8% of the matmul (docs/results/benchmarks.md,
    10th session). The keys' bias adds q . b_k to every score of a query, which the softmax removes (it
    is shift-invariant), unless k_norm normalises the keys first; the values' bias adds b_v to each
    head's output, as every row of probabilities sums to 1. The kernel adds it there (``v_bias``), and
    the shared queries get theirs added to their columns alone."""
    return not needs_grad(attn, x) and isinstance(attn.k_norm, torch.nn.Identity)


def routed_dense_forward(attn: HeadAttention, x: torch.Tensor, grouped: bool = False) -> torch.Tensor:
    """x: [B, N, C] -> [B, N, dim_out], the output of ``attn.forward(x)`` (no mask, not causal) through
    ``routed_kernel_dense``: one matmul for every head's queries, keys and values (and in float32 the
    router's logits), the chosen pairs' attention in the kernel (bfloat16: on AMX tiles), one output
    matmul. With ``grouped`` (``routed_kernel_grouped``), where ``grouped_projection_runs``, the output
    projection multiplies the chosen pairs alone instead (``moh_routed_proj``: the tokens grouped by the
    routed heads they chose, each group by its heads' columns of W_O); elsewhere it is
    ``routed_kernel_dense``. Call only when ``routed_kernel_supported(attn)`` is None."""
    dtype = compute_dtype(x)
    op = moh_routed_attention_op(dtype, attn.head_dim)
    if op is None or not kernel_path_runs(attn, x, DENSE_KERNEL_PATH) or _get_current_dispatch_mode() is not None:
        return sparse_moh_forward(attn, x, projections="dense")
    B, N, C = x.shape
    T = B * N
    H, d, Hkv = attn.num_heads, attn.head_dim, attn.num_kv_heads
    x = x.to(dtype).contiguous()
    widths = [attn.attn_dim, attn.kv_dim, attn.kv_dim]
    # Without qkv's bias (_bias_after_matmul): the kernel adds the queries' and the values' to the pairs
    # it computes; the keys' cancels in the softmax. In bf16 the router's logits stay apart: 16 more
    # columns misalign the rows of a bf16 matmul (8th session).
    if attn.router_columns and dtype == torch.float32:
        (q, k, v), logits = attn.linear_with_logits(x, [attn.qkv.weight], None, widths)
    else:
        qkv = torch.nn.functional.linear(x, matmul_param(attn.qkv.weight, dtype))
        (q, k, v), logits = qkv.split(widths, dim=-1), None
    q_b = k_b = v_b = None
    if attn.qkv.bias is not None:
        q_b, k_b, v_b = attn.qkv.bias.float().split(widths)
    k = k.view(B, N, Hkv, d)
    if k_b is not None and not isinstance(attn.k_norm, torch.nn.Identity):  # normalised keys keep their bias
        k = k + k_b.view(Hkv, d).to(dtype)
    k = attn.k_norm(k.transpose(1, 2)).to(dtype)  # [B, Hkv, N, d]
    v = v.view(B, N, Hkv, d).transpose(1, 2)
    gates, selected = attn.route(x, None, logits=logits)  # [B, N, H] each
    shared = attn.router.shared_heads
    routed_mask = _routed_mask(selected, shared)
    # every head's gated output, written over the queries (each pair's query is read before its output is
    # written): no [T, H*d] buffer to allocate and fault in, 3% of the layer in bf16 (12th session)
    z = q.reshape(T, attn.attn_dim)
    grouped = grouped and grouped_projection_runs(attn, dtype)
    # the grouped projection reads no pair that is off: no zeros to write there
    op(z, q_b, k, v, v_b, routed_mask, gates.reshape(T, H).float(), shared, 0, z, zero_off=not grouped)
    if grouped:
        return attn.proj_drop(_grouped_projection(attn, z, routed_mask, dtype).view(B, N, -1))
    bias = matmul_param(attn.proj.bias, dtype) if attn.proj.bias is not None else None
    out = torch.nn.functional.linear(z, matmul_param(attn.proj.weight, dtype), bias)
    return attn.proj_drop(out.view(B, N, -1))


def _grouped_projection(attn: HeadAttention, z: torch.Tensor, routed_mask: torch.Tensor, dtype: torch.dtype
                        ) -> torch.Tensor:
    """z: [T, H*d] the heads' gated outputs (its pairs that are off are not read), routed_mask [E, T] ->
    [T, dim_out]: ``attn.proj`` of the chosen pairs in ``moh_routed_proj``. A float32 weight is rounded to
    bf16 as the kernel packs it (as autocast's cast rounds it, without a copy per call); the bias is
    rounded to bf16 too, as F.linear's under autocast."""
    weight, bias = attn.proj.weight, attn.proj.bias
    if weight.dtype not in (torch.float32, dtype):
        weight = weight.to(dtype)
    bias = bias.to(dtype).float() if bias is not None else None
    op = moh_routed_proj_op(dtype, attn.head_dim)
    return op(z, routed_mask, attn.router.shared_heads, weight.contiguous(), bias)


def _routed_mask(selected: torch.Tensor, shared: int) -> torch.Tensor:
    """selected: [B, N, H] bool -> the routed heads' rows [H - shared, B * N], head-major, as the kernel
    reads them."""
    B, N, H = selected.shape
    return selected.permute(2, 0, 1).reshape(H, B * N)[shared:].contiguous()


def _same_in_pytorch(attn: HeadAttention, x: torch.Tensor, every_head: bool) -> torch.Tensor:
    """The computation a kernel path makes, in PyTorch: masked dense for every head, else the selected
    pairs only (``sparse_projections``; head choice's ``head_gather``, the same pairs in static shapes)."""
    if every_head:
        return attn.dense_forward(x)
    if attn.router.routing == "head_choice":
        return head_gather_forward(attn, x, output="rows")
    return sparse_moh_forward(attn, x, projections="sparse")


class _HeadsLoops(torch.autograd.Function):
    """``routed_kernel_loops`` with gradients: the kernel forward (``op``: every head, no bias) and its
    compiled backward (``moh_routed_heads_backward``: recomputes each head's attention per image, as
    flash attention does). x: [T, C], wq: the query rows of qkv's weight [H*d, C] (bq their bias or None),
    wo: proj's weight [Co, H*d], k/v: [B, Hkv, N, d], routed_mask: [E, T] bool, gates: [T, H] ->
    [T, Co]. The selection gets no gradient; the gates carry the router's."""

    @staticmethod
    def forward(ctx, op, x, wq, bq, wo, k, v, routed_mask, gates, shared):  # noqa: D102
        out = x.new_zeros(x.shape[0], wo.shape[0])
        op(x, wq, bq, wo, k, v, None, routed_mask, gates, shared, 0, True, out)
        ctx.save_for_backward(x, wq, bq, wo, k, v, routed_mask, gates)
        ctx.shared = shared
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        x, wq, bq, wo, k, v, routed_mask, gates = ctx.saved_tensors
        dx, dwq, dbq, dwo, dk, dv, dgates = torch.ops.visattn.moh_routed_heads_backward(
            grad.contiguous(), x, wq, bq, wo, k, v, routed_mask, gates, ctx.shared
        )
        return None, dx, dwq, dbq if bq is not None else None, dwo, dk, dv, None, dgates, None
