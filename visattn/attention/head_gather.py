"""Head-choice MoH with static shapes: every routed head attends with exactly ``c`` gathered queries.

Under ``routing="head_choice"`` (``visattn.attention.routing``) every routed head takes the same
number ``c`` of tokens from every image, so the routed work is a rectangle and needs no per-head
loop, no padding and no data-dependent group sizes:

- keys and values are projected for every token (any chosen query may attend to any token);
- the chosen tokens are gathered once, ``[E, B * c, C]``, and each routed head projects only its
  own queries in one batched matmul (``bmm`` over the E heads);
- one SDPA call attends ``[E, B, c, d]`` queries against their image's ``[E, B, N, d]`` keys;
- the outputs, times their gates, reach the output projection in one of two ways (``output``):
  ``"rows"``: each head's rows through its slice of ``W_O`` in one ``bmm``, added to the shared
  heads' rows with ``index_add`` (output projection shrinks with the budget); ``"dense"``: scattered
  into a zero ``[B, N, H, d]`` buffer and projected as ``mha`` does (one wide matmul, no wide adds).
Shared heads are computed densely, as in ``visattn.attention.sparse``.

Both equal ``HeadAttention.dense_forward`` up to float rounding and are differentiable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import HeadAttention
from .scores import expand_kv_groups
from .sparse import compute_dtype, linear_rows, param_slice, shared_kv

OUTPUTS = ("rows", "dense")


def head_gather_supported(attn: HeadAttention) -> str | None:
    """None when ``attn`` can run the head-gather path, else the reason it cannot (call after
    ``sparse_moh_supported`` found the layer fit for sparse paths)."""
    router = attn.router
    if router is None or router.routing != "head_choice":
        return "the layer does not route with routing='head_choice'"
    if router.routed_topk == 0:
        return "routed_topk=0: every head is on, there is nothing to gather"
    if router.router_kind != "linear":
        return "router='l2norm' scores every head's query, so no query projection can be skipped"
    return None


def head_gather_forward(attn: HeadAttention, x: torch.Tensor, output: str = "rows") -> torch.Tensor:
    """x: [B, N, C] -> [B, N, dim_out], the output of ``attn.dense_forward(x)``.
    Call only when ``head_gather_supported(attn)`` is None; ``output``: see the module docstring."""
    if output not in OUTPUTS:
        raise ValueError(f"output={output!r} is not known; use one of {OUTPUTS}")
    B, N, _ = x.shape
    x = x.to(compute_dtype(x))  # cast once (under autocast) rather than per gather
    k, v = _project_kv(attn, x)
    gates, selected = attn.route(x, None)  # [B, N, H] each (the linear router reads x only)
    shared = attn.router.shared_heads
    tokens = _chosen_tokens(selected[..., shared:])  # [E, B, c]
    flat = (tokens + torch.arange(B, device=x.device).view(1, B, 1) * N).reshape(-1)  # rows b * N + n
    routed = _routed_heads(attn, x, k, v, gates, tokens, flat)  # [E, B, c, d]
    shared_out = _shared_heads(attn, x, k, v, gates) if shared else None  # [B, shared, N, d]
    merge = _merge_rows if output == "rows" else _merge_dense
    out = merge(attn, shared_out, routed, flat, B * N)
    return attn.proj_drop(out.view(B, N, -1))


def _project_kv(attn: HeadAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, N, C] -> k, v: [B, H_kv, N, d] (k through ``k_norm``)."""
    B, N, _ = x.shape
    kv_w, kv_b = linear_rows(attn.qkv, attn.attn_dim, attn.attn_dim + 2 * attn.kv_dim, compute_dtype(x))
    k, v = F.linear(x, kv_w, kv_b).view(B, N, 2, attn.num_kv_heads, attn.head_dim).unbind(2)
    return attn.k_norm(k.transpose(1, 2)), v.transpose(1, 2)


def _chosen_tokens(selected: torch.Tensor) -> torch.Tensor:
    """selected: [B, N, E] with the same count c of True per (image, head) -> positions [E, B, c],
    ascending within each image."""
    B, N, E = selected.shape
    c = int(selected[0, :, 0].sum()) if B and E else 0
    return selected.permute(2, 0, 1).nonzero()[:, 2].view(E, B, c)


def _routed_heads(
    attn: HeadAttention,
    x: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gates: torch.Tensor,
    tokens: torch.Tensor,
    flat: torch.Tensor,
) -> torch.Tensor:
    """Gated outputs [E, B, c, d] of the routed heads for their chosen tokens [E, B, c] (positions;
    ``flat``: the same as rows b * N + n of x, [E * B * c]). x: [B, N, C], k/v: [B, H_kv, N, d],
    gates: [B, N, H]."""
    B, N, C = x.shape
    E, _, c = tokens.shape
    H, d = attn.num_heads, attn.head_dim
    shared = H - E
    chosen = x.reshape(B * N, C).index_select(0, flat).view(E, B * c, C)
    q_w, q_b = linear_rows(attn.qkv, shared * d, H * d, compute_dtype(x))
    q_w = q_w.view(E, d, C).transpose(1, 2)  # [E, C, d]
    q = torch.bmm(chosen, q_w) if q_b is None else torch.baddbmm(q_b.view(E, 1, d), chosen, q_w)
    q = attn.q_norm(q.view(E, B, c, d))
    group = H // attn.num_kv_heads
    k_r = expand_kv_groups(k, group)[:, shared:].transpose(0, 1)  # [E, B, N, d]
    v_r = expand_kv_groups(v, group)[:, shared:].transpose(0, 1)
    dropout_p = attn.attn_drop.p if attn.training else 0.0
    o = F.scaled_dot_product_attention(q, k_r, v_r, dropout_p=dropout_p)  # [E, B, c, d]
    g = gates[..., shared:].permute(2, 0, 1).gather(2, tokens)  # [E, B, c]
    return o * g.unsqueeze(-1).to(o.dtype)


def _shared_heads(
    attn: HeadAttention, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: torch.Tensor
) -> torch.Tensor:
    """Gated outputs [B, shared, N, d] of heads 0..shared-1 for every token."""
    B, N, _ = x.shape
    d, shared = attn.head_dim, attn.router.shared_heads
    q = F.linear(x, *linear_rows(attn.qkv, 0, shared * d, compute_dtype(x)))
    q = attn.q_norm(q.view(B, N, shared, d).transpose(1, 2))
    k, v = shared_kv(k, v, shared, attn.num_heads // attn.num_kv_heads)
    dropout_p = attn.attn_drop.p if attn.training else 0.0
    o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    return o * gates[..., :shared].transpose(1, 2).unsqueeze(-1).to(o.dtype)


def _merge_rows(
    attn: HeadAttention, shared_out: torch.Tensor | None, routed: torch.Tensor, flat: torch.Tensor, T: int
) -> torch.Tensor:
    """[T, dim_out]: the shared heads (and bias) through their slice of ``W_O``, plus each routed
    head's rows through its slice, added at their tokens ``flat`` ([E * B * c], b * N + n)."""
    proj = attn.proj
    E, B, c, d = routed.shape
    width = proj.out_features
    shared = attn.num_heads - E
    if shared_out is not None:
        merged = shared_out.transpose(1, 2).reshape(T, shared * d)
        w_shared = param_slice(proj.weight, (slice(None), slice(None, shared * d)), routed.dtype)
        out = F.linear(merged, w_shared, proj.bias)
    else:
        out = routed.new_zeros(T, width) if proj.bias is None else proj.bias.to(routed.dtype).expand(T, width)
    w_o = param_slice(proj.weight, (slice(None), slice(shared * d, None)), routed.dtype)
    w_o = w_o.view(width, E, d).permute(1, 2, 0)  # [E, d, dim_out]
    rows = torch.bmm(routed.reshape(E, B * c, d), w_o.to(routed.dtype))
    return out.to(rows.dtype).index_add(0, flat, rows.reshape(-1, width))


def _merge_dense(
    attn: HeadAttention, shared_out: torch.Tensor | None, routed: torch.Tensor, flat: torch.Tensor, T: int
) -> torch.Tensor:
    """[T, dim_out]: every head's gated output placed in a zero [T, H, d] buffer (routed heads at
    their chosen tokens ``flat``), then the full output projection."""
    E, B, c, d = routed.shape
    H = attn.num_heads
    shared = H - E
    heads = routed.new_zeros(T, H, d)
    if shared_out is not None:
        heads[:, :shared] = shared_out.transpose(1, 2).reshape(T, shared, d).to(heads.dtype)
    head = torch.arange(shared, H, device=flat.device).view(E, 1).expand(E, B * c).reshape(-1)
    heads = heads.view(T * H, d).index_copy(0, flat * H + head, routed.reshape(-1, d))
    return attn.proj(heads.view(T, H * d))
