"""Head-dimension allocation (seed 003): fixed uneven head widths and learned adaptive widths.

A different number of heads per layer is a per-layer budget (``num_heads`` per layer), not a module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn as nn

from .base import HeadAttention
from .registry import register_attention


@register_attention("uneven")
class UnevenHeadAttention(HeadAttention):
    """Heads of different widths: ``head_dims=[d_1, ..., d_H]`` summing to the inner width
    (``num_heads * head_dim``, by default ``dim``); None = equal widths (exactly ``mha``).

    Head h attends with its own scale 1/sqrt(d_h). Internally heads are zero-padded to the widest one
    (``[B, H, N, max d_h]``), so SDPA and MoH routing (``shared_heads`` / ``routed_topk``) work
    unchanged; zero channels add nothing to q.k and their outputs are dropped before ``proj``.
    The qkv/proj layout is MHA's with head h at its offset in ``cumsum(head_dims)``.
    """

    list_kwargs = ("head_dims",)

    def __init__(self, dim: int, num_heads: int = 8, *, head_dims: Sequence[int] | None = None, **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        if head_dims is None:
            head_dims = [self.head_dim] * num_heads
        head_dims = [int(d) for d in head_dims]
        if len(head_dims) != num_heads or min(head_dims) < 1 or sum(head_dims) != self.attn_dim:
            raise ValueError(
                f"head_dims={head_dims} must be {num_heads} positive widths (one per head) summing to the "
                f"inner width num_heads * head_dim = {self.attn_dim}"
            )
        self.head_dims = head_dims
        self.uneven = len(set(head_dims)) > 1
        if self.uneven and self.num_kv_heads != num_heads:
            raise ValueError(f"uneven head_dims={head_dims} need num_kv_heads=num_heads={num_heads} (no GQA)")
        if self.uneven and not isinstance(self.q_norm, nn.Identity):
            raise ValueError(f"qk_norm normalises a fixed head width; it cannot be used with head_dims={head_dims}")
        width = max(head_dims)
        self.padded_dim = width
        # Position of every real channel in the padded [H * width] layout.
        index = torch.cat([h * width + torch.arange(d) for h, d in enumerate(head_dims)])
        self.register_buffer("channel_index", index, persistent=False)
        # SDPA scales by 1/sqrt(width); head h needs 1/sqrt(d_h).
        rescale = torch.tensor([math.sqrt(width / d) for d in head_dims]).view(num_heads, 1, 1)
        self.register_buffer("query_rescale", rescale, persistent=False)

    def _pad(self, t: torch.Tensor) -> torch.Tensor:
        """[B, N, sum d_h] -> [B, H, N, width]."""
        B, N, _ = t.shape
        padded = t.new_zeros(B, N, self.num_heads * self.padded_dim).index_copy(-1, self.channel_index, t)
        return padded.view(B, N, self.num_heads, self.padded_dim).transpose(1, 2)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, N, C] -> q, k, v [B, H, N, max d_h] (zero-padded per head)."""
        if not self.uneven:
            return self.project_equal_heads(x)
        q, k, v = self.qkv(x).split([self.attn_dim] * 3, dim=-1)
        return self._pad(q), self._pad(k), self._pad(v)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        if self.uneven:
            q = q * self.query_rescale.to(q.dtype)
        return self.sdpa(q, k, v, attn_mask, is_causal)

    def merge_heads(self, x: torch.Tensor, heads: torch.Tensor, gates: torch.Tensor | None) -> torch.Tensor:
        """heads: [B, H, N, max d_h] weighted by gates [B, N, H] -> [B, N, dim_out]."""
        if not self.uneven:
            return self.merge_equal_heads(x, heads, gates)
        B, H, N, d = heads.shape
        if gates is not None:
            heads = heads * gates.transpose(1, 2).unsqueeze(-1).to(heads.dtype)
        flat = heads.transpose(1, 2).reshape(B, N, H * d).index_select(-1, self.channel_index)
        # Hand the unpadded heads to the shared tail (norm, gate, proj) as one head of width sum d_h.
        return self.merge_equal_heads(x, flat.unsqueeze(1), None)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, head_dims={self.head_dims}"


@register_attention("adaptive")
class AdaptiveHeadAttention(HeadAttention):
    """Learned per-head widths: head h owns ``head_dim`` (the max width) channels and uses about
    ``alpha_h * head_dim`` of them.

    The seed's ``alpha`` scales q, k, v by ``alpha * max_dim``, which changes magnitudes, not widths.
    Here ``alpha_h`` sets a soft channel mask ``m_h[i] = sigmoid(sharpness * (alpha_h * d - i - 1/2))``
    (a smoothed step at width alpha_h * d over unit-wide channels i = 0..d-1) applied to the queries (so only the first ~alpha_h*d channels enter q.k, scaled by
    1/sqrt(sum_i m_h[i])) and to the head output (so unused channels reach ``proj`` as zeros).
    ``alpha = 1`` at init keeps nearly every channel; ``stats["head_width"]`` ([H]) reports the
    effective widths ``sum_i m_h[i]``.
    """

    def __init__(self, dim: int, num_heads: int = 8, *, sharpness: float = 4.0, device=None, dtype=None,
                 **kwargs) -> None:
        super().__init__(dim, num_heads, device=device, dtype=dtype, **kwargs)
        if sharpness <= 0:
            raise ValueError(f"sharpness={sharpness} must be > 0 (slope of the channel mask)")
        self.sharpness = sharpness
        self.alpha = nn.Parameter(torch.ones(num_heads, device=device, dtype=dtype))
        self.register_buffer("channel_pos", torch.arange(self.head_dim, device=device, dtype=torch.float32),
                             persistent=False)

    def channel_mask(self) -> torch.Tensor:
        """[H, head_dim] soft mask of the channels each head uses."""
        width = self.alpha.float()[:, None] * self.head_dim
        return torch.sigmoid(self.sharpness * (width - self.channel_pos - 0.5))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        mask = self.channel_mask()
        width = mask.sum(dim=-1)
        self.stats["head_width"] = width.detach()
        mask = mask[:, None, :].to(q.dtype)  # [H, 1, d]
        # SDPA scales by 1/sqrt(head_dim); head h should see 1/sqrt(width_h).
        q = q * mask * (self.head_dim / width.clamp_min(1.0)).sqrt()[:, None, None].to(q.dtype)
        return self.sdpa(q, k, v, attn_mask, is_causal) * mask

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sharpness={self.sharpness}"
