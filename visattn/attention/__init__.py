"""Attention variants behind one registry; this package depends on torch and timm only."""

from . import cosine, headdim, mha, mta, relu  # noqa: F401  (register the variants by name)
from .base import HeadAttention
from .model_utils import (
    active_heads,
    attention_modules,
    attention_stats,
    aux_loss,
    convert_moh_state_dict,
    expand_per_layer,
    parse_attn_spec,
    per_layer_values,
    swap_attention,
)
from .registry import build_attention, get_attention_class, list_attentions, register_attention
from .routing import HeadRouter

__all__ = [
    "HeadAttention",
    "HeadRouter",
    "active_heads",
    "attention_modules",
    "attention_stats",
    "aux_loss",
    "build_attention",
    "convert_moh_state_dict",
    "expand_per_layer",
    "parse_attn_spec",
    "per_layer_values",
    "get_attention_class",
    "list_attentions",
    "register_attention",
    "swap_attention",
]
