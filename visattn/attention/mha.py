"""Standard multi-head attention (MHA) and its grouped key/value forms (GQA, MQA)."""

from __future__ import annotations

from .base import HeadAttention
from .registry import register_attention


@register_attention("mha")
class MultiHeadAttention(HeadAttention):
    """Plain multi-head attention; equals timm's ``Attention`` with the same weights."""


@register_attention("gqa")
class GroupedQueryAttention(HeadAttention):
    """Grouped-query attention: ``num_kv_heads`` key/value heads shared by groups of query heads
    (default: half the query heads)."""

    def __init__(self, dim: int, num_heads: int = 8, *, num_kv_heads: int | None = None, **kwargs) -> None:
        if num_kv_heads is None:
            num_kv_heads = max(1, num_heads // 2) if num_heads % 2 == 0 else num_heads
        super().__init__(dim, num_heads, num_kv_heads=num_kv_heads, **kwargs)


@register_attention("mqa")
class MultiQueryAttention(HeadAttention):
    """Multi-query attention: one key/value head for all query heads."""

    def __init__(self, dim: int, num_heads: int = 8, **kwargs) -> None:
        if kwargs.get("num_kv_heads", 1) != 1:
            raise ValueError(
                f"mqa has exactly one key/value head; got num_kv_heads={kwargs['num_kv_heads']}, use gqa"
            )
        kwargs.pop("num_kv_heads", None)
        super().__init__(dim, num_heads, num_kv_heads=1, **kwargs)
