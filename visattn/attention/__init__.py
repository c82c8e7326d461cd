"""Attention variants behind one registry; this package depends on torch and timm only."""

from . import cosine, headdim, mha, moh, mta, relu  # noqa: F401  (register the variants by name)
from .base import HeadAttention
from .model_ops import (
    active_heads,
    attention_modules,
    attention_stats,
    aux_loss,
    convert_moh_state_dict,
    impl_choices,
    swap_attention,
)
from .registry import build_attention, get_attention_class, list_attentions, register_attention
from .routing import HeadRouter
from .spec import expand_per_layer, parse_attn_spec, per_layer_values
from .train_paths import apply_train_paths, choose_train_paths

__all__ = [
    "HeadAttention",
    "HeadRouter",
    "active_heads",
    "attention_modules",
    "attention_stats",
    "apply_train_paths",
    "aux_loss",
    "build_attention",
    "choose_train_paths",
    "convert_moh_state_dict",
    "expand_per_layer",
    "parse_attn_spec",
    "per_layer_values",
    "get_attention_class",
    "impl_choices",
    "list_attentions",
    "register_attention",
    "swap_attention",
]
