"""Models built from the attention registry (ViT, TransNeXt, DiT)."""

from . import (
    transnext,  # noqa: F401  (registers visattn_transnext_* and visattn_moh_transnext_* with timm)
    vit,  # noqa: F401
)
