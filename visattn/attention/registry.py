"""Name -> attention class. Every class takes (dim, num_heads=8, **kwargs) and honours the timm
contract (forward(x, attn_mask=None, is_causal=False), timm's constructor keywords)."""

from __future__ import annotations

import torch.nn as nn

_ATTENTIONS: dict[str, type[nn.Module]] = {}


def register_attention(name: str):
    """Class decorator: make a variant buildable by name."""

    def wrap(cls: type[nn.Module]) -> type[nn.Module]:
        if name in _ATTENTIONS and _ATTENTIONS[name] is not cls:
            raise ValueError(f"attention {name!r} is already registered to {_ATTENTIONS[name].__qualname__}")
        _ATTENTIONS[name] = cls
        return cls

    return wrap


def list_attentions() -> list[str]:
    return sorted(_ATTENTIONS)


def get_attention_class(name: str) -> type[nn.Module]:
    try:
        return _ATTENTIONS[name]
    except KeyError:
        raise ValueError(f"unknown attention {name!r}; registered: {', '.join(list_attentions())}") from None


def build_attention(name: str, dim: int, num_heads: int = 8, **kwargs) -> nn.Module:
    """Build a registered attention: x [B, N, dim] -> [B, N, dim_out or dim]."""
    return get_attention_class(name)(dim, num_heads=num_heads, **kwargs)
