"""Sparse Mixture-of-Head inference: work only for the (token, head) pairs the router selected.

The dense path (``HeadAttention.forward``) computes every head for every token and multiplies the
unselected ones by a zero gate. Two plans skip that work; keys and values are projected for every
token in both (every selected query may attend to any token of its image).

Sparse projections (few tokens per routed head, the default up to half):
- shared heads (on for every token) get one dense query projection, one SDPA call and one output
  projection with their slice of ``W_O`` (plus the bias);
- each routed head gathers the tokens that selected it, projects only their queries, attends with
  them (grouped per image and zero-padded to that head's largest group: SDPA needs a rectangle)
  and projects only their outputs with its slice of ``W_O``;
- every token then sums its rows (its shared row and its ``routed_topk`` routed rows, times their
  gates) in one ``embedding_bag``: top-k routing gives every token the same number of rows, so this
  gather-and-sum replaces a scatter-add, which is several times slower on CPU.
So the query projection, the attention core and the output projection all shrink with the budget,
and routing adds nothing to the projections (the linear router reads ``x`` only).

Dense projections (most tokens per routed head, or the ``l2norm`` router, which scores every
head's query): one qkv and one output matmul as in ``mha``; only the attention of unselected pairs
is skipped. Per-head gathers and narrow matmuls would cost more than they save there.

Both equal the dense path up to float rounding, and are differentiable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from visattn.kernels import autocast_weight_op

from .base import HeadAttention
from .fused_gating import functorch_active
from .scores import expand_kv_groups
from .tracing import autocast_enabled


def sparse_moh_supported(attn: HeadAttention) -> str | None:
    """None when ``attn`` can run the sparse path, else the reason it cannot."""
    if attn.router is None:
        return "the layer does not route heads (routed_topk is None)"
    cls = type(attn)
    for method in ("attend", "project_qkv", "merge_heads"):
        if getattr(cls, method) is not getattr(HeadAttention, method):
            return f"{cls.__name__} overrides {method}, which the sparse path does not reproduce"
    if attn.gate is not None or not isinstance(attn.norm, torch.nn.Identity):
        return "gated=True / scale_norm=True mix all heads before the output projection"
    return None


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if autocast_enabled(device) else x.dtype


def matmul_param(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A weight or bias for an ``F.linear`` in ``dtype`` (``compute_dtype``): as it is under autocast, which
    casts it itself and keeps the cast for the rest of the autocast region, as for ``nn.Linear`` (a
    sampling loop casts each weight once), or that cast itself (``autocast_cast``); cast here otherwise.
    Cast here on every call under autocast too, qkv's and proj's weights had cost the bf16
    ``routed_kernel_dense`` 1.4 + 0.35 ms a DiT-B/2 layer that ``mha`` did not pay (12th session)."""
    if not autocast_enabled(p.device.type):
        return p.to(dtype)
    cached = autocast_cast(p, dtype)
    return p if cached is None else cached


def param_slice(p: torch.Tensor, index, dtype: torch.dtype) -> torch.Tensor:
    """``p[index]`` for a matmul in ``dtype``: a slice of autocast's own cast of p where there is one
    (``autocast_cast``), else of p (the matmul casts it: autocast caches no slice, a view, so under autocast
    that cast is made on every call)."""
    cached = autocast_cast(p, dtype)
    return (p if cached is None else cached)[index]


def cast_param(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """p in ``dtype``: autocast's own cast where there is one (``autocast_cast``), else a cast made here."""
    cached = autocast_cast(p, dtype)
    return p.to(dtype) if cached is None else cached


def autocast_cast(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The cast of float32 parameter p that CPU autocast made, or makes now and keeps, for the rest of its
    region (``torch.ops.visattn.autocast_weight``), so that slices of it cost no cast per call; None
    outside CPU autocast to ``dtype``, with gradients (the op has no backward), outside eager mode
    (torch.compile, dispatch modes, ``torch.func``) and without the kernels."""
    if (
        not isinstance(p, torch.Tensor)  # first: an fx Proxy's attributes cannot be tested
        or p.device.type != "cpu"
        or p.dtype != torch.float32
        or not torch.is_autocast_enabled("cpu")
        or torch.get_autocast_dtype("cpu") != dtype
        or torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or _get_current_dispatch_mode() is not None
        or functorch_active()
    ):
        return None
    op = autocast_weight_op()
    return None if op is None else op(p)


def linear_rows(
    linear: torch.nn.Linear, start: int, stop: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Output rows start..stop of a linear layer for a matmul in ``dtype``: (weight [stop - start, in], bias
    or None), slices of autocast's casts where there are some (``param_slice``)."""
    bias = param_slice(linear.bias, slice(start, stop), dtype) if linear.bias is not None else None
    return param_slice(linear.weight, slice(start, stop), dtype), bias


class _Rows:
    """The [rows, dim_out] matrix of per-token contributions, filled block by block.

    Without autograd each block's matmul writes straight into one preallocated buffer; with autograd
    (``out=`` is not differentiable) the blocks are concatenated instead.
    """

    def __init__(self, rows: int, width: int, like: torch.Tensor, params: list[torch.Tensor]) -> None:
        needs_grad = torch.is_grad_enabled() and (like.requires_grad or any(p.requires_grad for p in params))
        self.buffer = None if needs_grad else like.new_empty(rows, width)
        self.blocks: list[torch.Tensor] = []
        self.filled = 0

    def linear(self, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Append a @ weight^T (+ bias) in the buffer's dtype (the autocast dtype under autocast)."""
        if self.buffer is None:
            self.blocks.append(F.linear(a, weight, bias))
            return
        out = self.buffer[self.filled : self.filled + a.shape[0]]
        with torch.autocast(out.device.type, enabled=False):
            a, weight_t = a.to(out.dtype), weight.to(out.dtype).t()
            if bias is None:
                torch.mm(a, weight_t, out=out)
            else:
                torch.addmm(bias.to(out.dtype), a, weight_t, out=out)
        self.filled += a.shape[0]

    def row(self, value: torch.Tensor) -> None:
        """Append one row (e.g. the bias)."""
        if self.buffer is None:
            self.blocks.append(value.unsqueeze(0))
        else:
            self.buffer[self.filled] = value
            self.filled += 1

    def result(self) -> torch.Tensor:
        return (
            self.buffer
            if self.buffer is not None
            else torch.cat(self.blocks).to(compute_dtype(self.blocks[0]))
        )


PROJECTIONS = ("auto", "sparse", "dense")
# Above this share of tokens per routed head, per-head gathers and narrow matmuls cost more than
# they save: project densely (one qkv and one output matmul, like mha) and skip only attention.
SPARSE_PROJECTION_MAX_DENSITY = 0.5


def routed_density(attn: HeadAttention) -> float:
    """Share of tokens each routed head serves on average: routed_topk / routed pool (1 when dense)."""
    router = attn.router
    return router.routed_topk / router.pool if router.routed_topk else 1.0


def sparse_moh_forward(attn: HeadAttention, x: torch.Tensor, projections: str = "auto") -> torch.Tensor:
    """x: [B, N, C] -> [B, N, dim_out]; the output of ``attn.forward(x)`` (no mask, not causal).

    ``projections``: ``"sparse"`` (queries and outputs projected per selected pair), ``"dense"``
    (every head projected, only the attention of selected pairs computed), or ``"auto"``: sparse up
    to ``SPARSE_PROJECTION_MAX_DENSITY`` tokens per routed head. The ``l2norm`` router scores every
    head's query, so it always projects densely, and so does head choice under ``"auto"`` (its
    static-shape path is ``visattn.attention.head_gather``). Call only when ``sparse_moh_supported(attn)`` is None.
    """
    if projections not in PROJECTIONS:
        raise ValueError(f"projections={projections!r} is not known; use one of {PROJECTIONS}")
    head_choice = attn.router.routing == "head_choice"
    if head_choice and projections == "sparse":
        raise ValueError(
            "projections='sparse' needs token choice (routed_topk pairs per token); with routing='head_choice' "
            "use projections='dense' or visattn.attention.head_gather"
        )
    dense = (
        head_choice or routed_density(attn) > SPARSE_PROJECTION_MAX_DENSITY
        if projections == "auto"
        else projections == "dense"
    )
    if dense or attn.router.router_kind == "l2norm":
        return _dense_projections(attn, x)
    return _sparse_projections(attn, x)


def _dense_projections(attn: HeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Every head projected (as ``mha``); attention computed only for the selected pairs."""
    B, N, _ = x.shape
    T = B * N
    H, d = attn.num_heads, attn.head_dim
    group = H // attn.num_kv_heads
    router = attn.router
    dropout_p = attn.attn_drop.p if attn.training else 0.0
    x = x.to(compute_dtype(x))  # cast once for the projection and the router's linears
    q, k, v = attn.project_qkv(x)  # [B, H, N, d], [B, H_kv, N, d] x 2
    gates, selected = attn.route(x, q)
    shared = H if router.routed_topk == 0 else router.shared_heads

    heads = torch.empty(B, N, H, d, dtype=compute_dtype(x), device=x.device)  # gated head outputs
    if shared:
        ks, vs = shared_kv(k, v, shared, group)
        o = F.scaled_dot_product_attention(q[:, :shared], ks, vs, dropout_p=dropout_p)
        o = o * gates[..., :shared].transpose(1, 2).unsqueeze(-1).to(o.dtype)
        heads[:, :, :shared] = o.transpose(1, 2)
    heads[:, :, shared:] = 0
    rows = heads.view(T, H, d)
    gate_rows = gates.reshape(T, H)
    for head in range(shared, H):
        tokens = selected[..., head].reshape(T).nonzero().squeeze(1)
        if tokens.numel() == 0:
            continue
        q_sel = q[:, head].reshape(T, d).index_select(0, tokens)
        o = _attend_grouped(q_sel, tokens, N, k[:, head // group], v[:, head // group], dropout_p)
        o = o * gate_rows[:, head].index_select(0, tokens).unsqueeze(1).to(o.dtype)
        rows[:, head].index_copy_(0, tokens, o.to(rows.dtype))
    return attn.merge_heads(x, heads.permute(0, 2, 1, 3), None)


def _sparse_projections(attn: HeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Queries, attention and output projection only for the selected (token, head) pairs."""
    B, N, C = x.shape
    T = B * N
    H, d, Hkv = attn.num_heads, attn.head_dim, attn.num_kv_heads
    group = H // Hkv  # query heads per key/value head
    router = attn.router
    dropout_p = attn.attn_drop.p if attn.training else 0.0
    dtype = compute_dtype(x)
    x = x.to(dtype)  # cast once (under autocast) rather than once per gather

    kv_w, kv_b = linear_rows(attn.qkv, attn.attn_dim, attn.attn_dim + 2 * attn.kv_dim, dtype)
    k, v = F.linear(x, kv_w, kv_b).view(B, N, 2, Hkv, d).unbind(2)
    k = attn.k_norm(k.transpose(1, 2))  # [B, Hkv, N, d]
    v = v.transpose(1, 2)
    gates, selected = attn.route(x, None)  # [B, N, H] each (the linear router reads x only)

    shared = H if router.routed_topk == 0 else router.shared_heads
    topk = router.routed_topk
    routed = selected[..., shared:].reshape(T, H - shared)  # [T, E]; exactly topk True per row
    counts = routed.sum(0).tolist()  # tokens per routed head
    # Rows of `partial`, each a [dim_out] contribution: T shared-head rows (bias included) or one
    # bias row, then the routed (token, head) pairs grouped by head, in token order within a head.
    first_pair = T if shared else int(attn.proj.bias is not None)
    partial = _Rows(first_pair + sum(counts), attn.proj.out_features, x, list(attn.parameters()))
    if shared:
        _shared_heads(partial, attn, x, k, v, gates, shared, group, dropout_p)
    elif attn.proj.bias is not None:
        partial.row(attn.proj.bias.to(dtype))

    x_rows = x.reshape(T, C)
    for e, count in enumerate(counts):
        if count == 0:
            continue
        head = shared + e
        tokens = routed[:, e].nonzero().squeeze(1)  # flat b * N + n, ascending
        q_w, q_b = linear_rows(attn.qkv, head * d, (head + 1) * d, dtype)
        q = attn.q_norm(F.linear(x_rows.index_select(0, tokens), q_w, q_b))  # [count, d]
        kv_head = head // group
        o = _attend_grouped(q, tokens, N, k[:, kv_head], v[:, kv_head], dropout_p)  # [count, d]
        partial.linear(o, param_slice(attn.proj.weight, (slice(None), slice(head * d, (head + 1) * d)), dtype), None)

    # Per token, the indices of its rows in `partial` ([shared/bias row,] then its topk pair rows)
    # and their weights (1, then the routed gates; the shared rows are gated already).
    rows = partial.result()
    head_start = torch.tensor([0, *counts[:-1]], device=x.device).cumsum(0) + first_pair  # [E]
    bags = (routed.cumsum(0) - 1 + head_start)[routed].view(T, topk)
    weights = gates[..., shared:].reshape(T, -1)[routed].view(T, topk).to(rows.dtype)
    if shared or attn.proj.bias is not None:
        bags = torch.cat([_own_rows(T, shared, x.device), bags], dim=1)
        weights = torch.cat([weights.new_ones(T, 1), weights], dim=1)
    with torch.autocast(x.device.type, enabled=False):  # sum in the rows' dtype, no cast of `rows`
        out = F.embedding_bag(bags, rows, mode="sum", per_sample_weights=weights)  # [T, dim_out]
    return attn.proj_drop(out.view(B, N, -1))


def _own_rows(T: int, shared: int, device: torch.device) -> torch.Tensor:
    """[T, 1]: each token's shared-heads row, or the single bias row (index 0) without shared heads."""
    if shared:
        return torch.arange(T, device=device).unsqueeze(1)
    return torch.zeros(T, 1, dtype=torch.long, device=device)


def _shared_heads(
    out: _Rows,
    attn: HeadAttention,
    x: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: torch.Tensor,
    shared: int,
    group: int,
    dropout_p: float,
    q: torch.Tensor | None = None,
    v_bias: torch.Tensor | None = None,
    out_bias: bool = True,
) -> None:
    """Heads 0..shared-1 densely, through their slice of the output projection plus its bias (unless
    ``out_bias`` is False: the caller adds it).

    x: [B, N, C], k/v: [B, H_kv, N, d], gates: [B, N, H], q: their queries [B, N, shared * d] when the
    caller computed them; v_bias: the values' bias [H_kv * d] when v was computed without it (each
    head's probabilities sum to 1, so it adds to the head's output); appends [B * N, dim_out] rows to
    ``out``."""
    B, N, _ = x.shape
    d = attn.head_dim
    if q is None:
        q_w, q_b = linear_rows(attn.qkv, 0, shared * d, compute_dtype(x))
        q = F.linear(x, q_w, q_b)
    q = attn.q_norm(q.view(B, N, shared, d).transpose(1, 2))
    k, v = shared_kv(k, v, shared, group)
    heads = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    gate = gates[..., :shared].transpose(1, 2).unsqueeze(-1).to(heads.dtype)
    in_place = not heads.requires_grad  # SDPA's fresh output: no allocation for the gating
    if v_bias is not None:
        head_bias = v_bias.view(-1, d).repeat_interleave(group, dim=0)[:shared].view(1, shared, 1, d)
        heads = heads.add_(head_bias) if in_place else heads + head_bias
    heads = heads.mul_(gate) if in_place else heads * gate
    merged = heads.transpose(1, 2).reshape(B * N, shared * d)
    w_o = param_slice(attn.proj.weight, (slice(None), slice(None, shared * d)), compute_dtype(x))
    out.linear(merged, w_o, attn.proj.bias if out_bias else None)


def shared_kv(k: torch.Tensor, v: torch.Tensor, shared: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v: [B, H_kv, N, d] -> the keys and values of query heads 0..shared-1, [B, shared, N, d] each
    (only the key/value heads those read are repeated)."""
    kv_heads = -(-shared // group)
    return tuple(expand_kv_groups(t[:, :kv_heads], group)[:, :shared] for t in (k, v))


def _attend_grouped(
    q: torch.Tensor, tokens: torch.Tensor, N: int, k: torch.Tensor, v: torch.Tensor, dropout_p: float
) -> torch.Tensor:
    """One head's selected queries against their own image's keys.

    q: [n, d] for the flat token indices ``tokens`` (ascending, b * N + position); k/v: [B, N, d].
    Queries are placed per image into a zero-padded [B, cap, d] block (cap = the largest group),
    attended in one SDPA call, and read back -> [n, d]. Padded rows are computed and discarded.
    """
    B = k.shape[0]
    image = tokens // N
    counts = torch.bincount(image, minlength=B)
    starts = torch.cumsum(counts, 0) - counts
    cap = int(counts.max())
    slot = image * cap + torch.arange(tokens.numel(), device=q.device) - starts[image]  # row in [B * cap]
    padded = q.new_zeros(B * cap, q.shape[1]).index_copy_(0, slot, q).view(B, 1, cap, -1)
    out = F.scaled_dot_product_attention(padded, k.unsqueeze(1), v.unsqueeze(1), dropout_p=dropout_p)
    return out.reshape(B * cap, -1).index_select(0, slot)
