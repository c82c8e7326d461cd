"""visattn: attention variants for vision and diffusion transformers, and honest benchmarks of them."""

from .attention import (
    HeadAttention,
    HeadRouter,
    active_heads,
    attention_stats,
    aux_loss,
    build_attention,
    convert_moh_state_dict,
    list_attentions,
    register_attention,
    swap_attention,
)

__all__ = [
    "HeadAttention",
    "HeadRouter",
    "active_heads",
    "attention_stats",
    "aux_loss",
    "build_attention",
    "convert_moh_state_dict",
    "list_attentions",
    "register_attention",
    "swap_attention",
]
__version__ = "0.1.0"

from . import models  # noqa: E402, F401  (registers visattn_vit_* and visattn_transnext_* with timm)
