"""Explicit attention-score helpers for variants that need the score map itself (ReLU, MTA).

SDPA semantics throughout: ``attn_mask`` is bool (True = attend) or float (added to the scores),
broadcastable to ``[B, H, N, M]``; ``is_causal`` keeps key j for query i when j <= i.

torch.fx: a traced model (timm's ``VisionTransformer.forward(x, attn_mask=None, is_causal=False)``)
hands ``attn_mask`` and ``is_causal`` to the attention as symbolic values, even when they are None /
False at run time, so no traced code may branch on them. The helpers that do (``additive_mask``,
``add_mask``, ``zero_masked``) are fx leaves: recorded as one call and run on the real values. fx patches
a leaf in the globals of the module that names it, so a module importing one names it again with
``torch.fx.wrap("name")`` at its top level; ``register_notrace_function`` lists them for timm.
"""

from __future__ import annotations

import torch
import torch.fx
from timm.layers import register_notrace_function


def expand_kv_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H_kv, M, d] -> [B, H_kv * groups, M, d]: query head h reads key/value head h // groups, as
    SDPA's GQA. ``groups`` (query heads per key/value head) is the layer's, so tracing needs no shapes."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def dot_scores(q: torch.Tensor, k: torch.Tensor, scale: float, groups: int = 1) -> torch.Tensor:
    """q: [B, H, N, d], k: [B, H / groups, M, d] -> scaled scores [B, H, N, M]."""
    return (q * scale) @ expand_kv_groups(k, groups).transpose(-2, -1)


@torch.fx.wrap
@register_notrace_function  # a leaf for torch.fx: branches on attn_mask and is_causal
def additive_mask(
    attn_mask: torch.Tensor | None, is_causal: bool, n: int, m: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """The mask as a float tensor broadcastable to [B, H, N, M] (0 = attend, -inf = masked), or None."""
    out: torch.Tensor | None = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            out = torch.zeros(attn_mask.shape, dtype=dtype, device=device).masked_fill(~attn_mask, float("-inf"))
        else:
            out = attn_mask.to(dtype)
    if is_causal:
        future = torch.ones(n, m, dtype=torch.bool, device=device).triu(1)
        causal = torch.zeros(n, m, dtype=dtype, device=device).masked_fill(future, float("-inf"))
        out = causal if out is None else out + causal
    return out


@torch.fx.wrap
@register_notrace_function  # a leaf for torch.fx: branches on whether there is a mask
def add_mask(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """scores [B, H, N, M] plus the additive mask (``additive_mask``'s output), or scores when it is None."""
    return scores if mask is None else scores + mask


@torch.fx.wrap
@register_notrace_function  # a leaf for torch.fx: branches on whether there is a mask
def zero_masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """x [B, H, N, M] with 0 where the additive mask is -inf (masked), or x when the mask is None."""
    return x if mask is None else x.masked_fill(~torch.isfinite(mask), 0.0)
