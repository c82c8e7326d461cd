"""Name -> attention class. Every class takes (dim, num_heads=8, **kwargs) and honours the timm
contract (forward(x, attn_mask=None, is_causal=False), timm's constructor keywords)."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterable

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


def attention_keywords(name: str) -> set[str]:
    """The keywords a variant's constructor takes, following ``**kwargs`` up to its base classes."""
    keywords: set[str] = set()
    for cls in get_attention_class(name).__mro__:
        if "__init__" not in vars(cls):
            continue
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # drop self
        keywords.update(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return keywords


def check_attention_keywords(name: str, keys: Iterable[str]) -> None:
    """Refuse keywords the variant does not take, naming the closest ones it does (a typo such as
    ``top_k`` for ``routed_topk`` would otherwise surface as a bare TypeError deep in a model build)."""
    accepted = attention_keywords(name)
    unknown = sorted(set(keys) - accepted)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, accepted, n=2, cutoff=0.5)
        hints.append(f"{key!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""))
    raise ValueError(
        f"attention {name!r} does not take {', '.join(hints)}; it takes: {', '.join(sorted(accepted))}"
    )


def build_attention(name: str, dim: int, num_heads: int = 8, **kwargs) -> nn.Module:
    """Build a registered attention: x [B, N, dim] -> [B, N, dim_out or dim]."""
    check_attention_keywords(name, kwargs)
    return get_attention_class(name)(dim, num_heads=num_heads, **kwargs)
