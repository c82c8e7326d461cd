"""ViT: timm's ``VisionTransformer`` with any registered attention, configurable per layer.

``attn`` is a registered name or a spec ``{"name": ..., **kwargs}`` whose values may be per-layer
lists (head budgets: ``shared_heads``, ``routed_topk``, ...); ``num_heads`` may be a per-layer list
too. The presets are registered with timm, so
``timm.create_model("visattn_vit_small_patch16_224", attn="moh", num_classes=100)`` works.
Parameter names stay timm's, so timm/DeiT weights load strictly into the ``mha`` model and into
``moh`` with only the routers left to initialise. Images: [B, in_chans, H, W] -> logits [B, classes].
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from timm.models import register_model
from timm.models._manipulate import named_apply
from timm.models.vision_transformer import VisionTransformer, init_weights_vit_timm

from visattn.attention import (
    active_heads,
    attention_modules,
    expand_per_layer,
    get_attention_class,
    parse_attn_spec,
    per_layer_values,
    swap_attention,
)

log = logging.getLogger(__name__)

VIT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny_patch16_224": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3),
    "small_patch16_224": dict(img_size=224, patch_size=16, embed_dim=384, depth=12, num_heads=6),
    "base_patch16_224": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12),
    # small images: scikit-learn digits (8 px) and Fashion-MNIST / CIFAR-sized inputs (28-32 px)
    "tiny_patch2_8": dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=64, depth=6,
                          num_heads=8, mlp_ratio=2.0),
    "tiny_patch4_32": dict(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=8, mlp_ratio=2.0),
}


def vision_transformer(
    attn: str | Mapping[str, Any] = "mha",
    num_heads: int | Sequence[int] = 12,
    depth: int = 12,
    **kwargs: Any,
) -> VisionTransformer:
    """A timm ``VisionTransformer`` (``kwargs`` as timm takes them) whose every attention layer is
    ``attn``, built per layer from the spec; new attention weights get timm's ViT initialisation."""
    name, attn_kwargs = parse_attn_spec(attn)
    heads = [int(h) for h in per_layer_values(num_heads, depth, "num_heads")]
    layers = expand_per_layer(name, attn_kwargs, depth)
    uniform = len(set(heads)) == 1
    model = VisionTransformer(depth=depth, num_heads=heads[0] if uniform else 1, **kwargs)
    for layer, h in zip(layers, heads, strict=True):
        layer["num_heads"] = h
        layer.setdefault("head_dim", None)  # dim / heads of this layer unless the spec fixes it
    for idx, layer in enumerate(layers):
        try:
            get_attention_class(name)(model.embed_dim, **{**layer, "device": "meta"})
        except (ValueError, TypeError) as err:
            raise ValueError(f"attention layer {idx} ({name}, {layer}): {err}") from None
    swap_attention(model, name, per_layer=layers)
    for _, module in attention_modules(model):
        named_apply(init_weights_vit_timm, module)
    active, total = active_heads(model)
    log.info("ViT with %s attention: %d/%d heads active per token (%.1f%%)", name, active, total, 100 * active / total)
    return model


def _create(preset: str, pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    if pretrained:
        raise ValueError(
            "visattn ViTs download nothing; load weights from a local file instead "
            "(train_cls.py model.init_from=PATH or ckpt=PATH, or visattn.utils.checkpoint.load_weights)"
        )
    for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
        kwargs.pop(key, None)
    return vision_transformer(**{**VIT_PRESETS[preset], **kwargs})


@register_model
def visattn_vit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    return _create("tiny_patch16_224", pretrained, **kwargs)


@register_model
def visattn_vit_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    return _create("small_patch16_224", pretrained, **kwargs)


@register_model
def visattn_vit_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    return _create("base_patch16_224", pretrained, **kwargs)


@register_model
def visattn_vit_tiny_patch2_8(pretrained: bool = False, **kwargs) -> VisionTransformer:
    return _create("tiny_patch2_8", pretrained, **kwargs)


@register_model
def visattn_vit_tiny_patch4_32(pretrained: bool = False, **kwargs) -> VisionTransformer:
    return _create("tiny_patch4_32", pretrained, **kwargs)

