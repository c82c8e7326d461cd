"""Explicit attention-score helpers for variants that need the score map itself (ReLU, MTA).

SDPA semantics throughout: ``attn_mask`` is bool (True = attend) or float (added to the scores),
broadcastable to ``[B, H, N, M]``; ``is_causal`` keeps key j for query i when j <= i.
"""

from __future__ import annotations

import torch


def expand_kv_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H_kv, M, d] -> [B, H_kv * groups, M, d]: query head h reads key/value head h // groups, as
    SDPA's GQA. ``groups`` (query heads per key/value head) is the layer's, so tracing needs no shapes."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def dot_scores(q: torch.Tensor, k: torch.Tensor, scale: float, groups: int = 1) -> torch.Tensor:
    """q: [B, H, N, d], k: [B, H / groups, M, d] -> scaled scores [B, H, N, M]."""
    return (q * scale) @ expand_kv_groups(k, groups).transpose(-2, -1)


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
