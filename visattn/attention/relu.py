"""ReLU attention: softmax replaced by a ReLU (or softplus) of the scores, then normalised.

Norms (s = q.k / sqrt(d), masked scores are -inf so their weight is exactly 0):
    ``"l1"``:       relu(s) / (sum_j relu(s) + eps)   (rows sum to 1, or are all zero)
    ``"seqlen"``:   relu(s) / M                        (M keys; Wortsman et al. 2023, ViT)
    ``"softplus"``: softplus(s) / (sum_j softplus(s) + eps)
The softplus form smooths the ReLU itself: softplus applied after the ReLU, read literally from the
seed, would floor every weight at log 2 and make the ReLU a no-op.
``stats["zero_fraction"]``: fraction of exact zeros among the unmasked attention weights.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from timm.layers import register_notrace_function

from .base import HeadAttention
from .registry import register_attention
from .scores import add_mask, additive_mask, dot_scores, expand_kv_groups
from .tracing import keeps_stats

NORMS = ("l1", "seqlen", "softplus")

# Leaves for torch.fx, patched in this module's globals (see visattn.attention.scores).
torch.fx.wrap("additive_mask")
torch.fx.wrap("add_mask")


@torch.fx.wrap
@register_notrace_function  # a leaf for torch.fx: branches on whether there is a mask
def zero_fraction(weights: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Fraction of exact zeros among the unmasked weights [B, H, N, M] (mask: ``additive_mask``'s)."""
    zeros = weights == 0
    if mask is None:
        return zeros.float().mean()
    unmasked = torch.isfinite(mask).expand_as(zeros)
    return (zeros & unmasked).sum() / unmasked.sum().clamp_min(1)


@register_attention("relu")
class ReLUAttention(HeadAttention):
    """Multi-head attention with ReLU weights. ``norm``: one of ``NORMS``; ``eps``: l1 denominator floor.
    Optional qk-norm through ``qk_norm=True`` (HeadAttention)."""

    def __init__(self, dim: int, num_heads: int = 8, *, norm: str = "l1", eps: float = 1e-6, **kwargs) -> None:
        if norm not in NORMS:
            raise ValueError(f"norm={norm!r} is not known; use one of {NORMS}")
        super().__init__(dim, num_heads, **kwargs)
        self.norm_kind = norm
        self.eps = eps

    def attention_weights(
        self, q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """q: [B, H, N, d], k: [B, H_kv, M, d] -> weights [B, H, N, M] (non-negative)."""
        scores = dot_scores(q, k, self.scale, self.num_heads // self.num_kv_heads)
        mask = additive_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], scores.dtype, scores.device)
        scores = add_mask(scores, mask)
        if self.norm_kind == "seqlen":
            weights = F.relu(scores) / k.shape[-2]
        else:
            weights = F.relu(scores) if self.norm_kind == "l1" else F.softplus(scores)
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.eps)
        if keeps_stats():
            with torch.no_grad():
                self.stats["zero_fraction"] = zero_fraction(weights, mask)
        return weights

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """q: [B, H, N, d], k/v: [B, H_kv, M, d] -> [B, H, N, d]."""
        weights = self.attn_drop(self.attention_weights(q, k, attn_mask, is_causal))
        return weights @ expand_kv_groups(v, self.num_heads // self.num_kv_heads).to(weights.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, norm={self.norm_kind}"
