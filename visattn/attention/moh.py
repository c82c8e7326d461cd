"""Mixture-of-Head attention (MoH, arXiv 2410.11842): routing on ``HeadAttention`` with MoH's default
budget, and the sparse inference path of ``visattn.attention.sparse``."""

from __future__ import annotations

import torch

from .base import HeadAttention
from .registry import register_attention
from .routing import default_budget
from .sparse import SPARSE_PROJECTION_MAX_DENSITY, routed_density, sparse_moh_forward, sparse_moh_supported

MOH_IMPLS = ("auto", "dense", "sparse")


@register_attention("moh")
class MoHAttention(HeadAttention):
    """Mixture-of-Head attention: shared heads always on, ``routed_topk`` of the rest per token.

    Without a budget it uses half the heads as shared and routes half of the remaining pool.
    ``impl``: ``"dense"`` computes every head and zeroes the unselected ones (the reference, and the
    training path); ``"sparse"`` computes only the selected (token, head) pairs
    (``visattn.attention.sparse``); ``"auto"`` (default) is sparse in eval mode where that measured
    faster (linear router, at most half of the routed pool per token), dense otherwise and in
    training. An attention mask or ``is_causal`` always takes the dense path.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        shared_heads: int | None = None,
        routed_topk: int | None = None,
        impl: str = "auto",
        **kwargs,
    ) -> None:
        if impl not in MOH_IMPLS:
            raise ValueError(f"impl={impl!r} is not known; use one of {MOH_IMPLS}")
        if routed_topk is None:
            shared_heads, routed_topk = default_budget(num_heads, shared_heads)
        super().__init__(dim, num_heads, shared_heads=shared_heads or 0, routed_topk=routed_topk, **kwargs)
        self.impl = impl
        reason = sparse_moh_supported(self)
        if impl == "sparse" and reason is not None:
            raise ValueError(f"impl='sparse' is not available here: {reason}; use impl='dense' or 'auto'")
        self.sparse_ok = reason is None
        # "auto" goes sparse in eval where that measured faster: linear router, at most half the pool.
        self.sparse_auto = (
            self.sparse_ok
            and self.router.router_kind == "linear"
            and routed_density(self) <= SPARSE_PROJECTION_MAX_DENSITY
        )

    def uses_sparse(self, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> bool:
        """Whether forward takes the sparse path for these arguments in the current mode."""
        if not self.sparse_ok or attn_mask is not None or is_causal:
            return False
        if self.impl == "auto":
            return self.sparse_auto and not self.training
        return self.impl == "sparse"

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """x: [B, N, C] -> [B, N, dim_out]; see ``HeadAttention.forward``.

        TorchScript always takes the dense path (the sparse one groups tokens with Python lists).
        Under ``torch.compile`` the sparse path is left eager (data-dependent group sizes would break
        the graph anyway); training, ``impl="dense"`` and a scripted module compile as one graph.
        """
        if not torch.jit.is_scripting() and self.uses_sparse(attn_mask, is_causal):
            return self.sparse_forward(x)
        return self.dense_forward(x, attn_mask, is_causal)

    @torch.jit.unused
    @torch.compiler.disable
    def sparse_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Only the selected (token, head) pairs computed (``visattn.attention.sparse``). x: [B, N, C].
        torch.fx records the dense path instead: a traced graph cannot hold data-dependent token groups;
        an empty batch takes it too (there are no tokens to group)."""
        if isinstance(x, torch.fx.Proxy) or x.numel() == 0:
            return self.dense_forward(x)
        return sparse_moh_forward(self, x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, impl={self.impl}"
