"""ViT: timm's ``VisionTransformer`` with any registered attention, configurable per layer.

``attn`` is a registered name or a spec ``{"name": ..., **kwargs}`` whose values may be per-layer
lists (head budgets: ``shared_heads``, ``routed_topk``, ...); ``num_heads`` may be a per-layer list
too. The presets are timm models built through ``build_model_with_cfg`` with a registered pretrained
config each, so ``timm.create_model("visattn_vit_small_patch16_224", attn="moh", num_classes=100)``,
``features_only=True``, ``forward_intermediates`` and ``timm.data.resolve_data_config`` work as for
timm's own ViTs, and ``pretrained=True, pretrained_cfg_overlay=dict(file=PATH)`` loads a local
DeiT/timm ViT or released MoH-ViT-style checkpoint through ``checkpoint_filter_fn``.
Parameter names stay timm's, so timm/DeiT weights load strictly into the ``mha`` model and into
``moh`` with only the routers left at their initialisation. Attention layers with a position bias
over the token grid (``cosine``) get the patch grid; prefix tokens get zero bias.
Images: [B, in_chans, H, W] -> logits [B, classes].
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._manipulate import named_apply
from timm.models.vision_transformer import VisionTransformer, init_weights_vit_timm
from timm.models.vision_transformer import checkpoint_filter_fn as timm_vit_filter

from visattn.attention import (
    active_heads,
    attention_modules,
    convert_moh_state_dict,
    expand_per_layer,
    get_attention_class,
    parse_attn_spec,
    per_layer_values,
    swap_attention,
)
from visattn.models.pretrained import require_local_weights

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
    swap_attention(model, name, per_layer=layers, warn_unkept=False)  # fresh model: nothing to keep
    for _, module in attention_modules(model):
        named_apply(init_weights_vit_timm, module)
    set_patch_grid(model)
    active, total = active_heads(model)
    log.info("ViT with %s attention: %d/%d heads active per token (%.1f%%)", name, active, total, 100 * active / total)
    return model


def set_patch_grid(model: VisionTransformer) -> None:
    """Give every attention layer with a grid position bias (``set_grid_size``) the patch grid.

    The grid is the last ``H * W`` tokens of the sequence; the class and register tokens in front
    get zero bias. ``dynamic_img_size`` changes the grid per input, which a fixed bias table cannot
    follow, so it is refused for such layers. After ``model.set_input_size(...)`` call this again.
    """
    layers = [m for _, m in attention_modules(model) if getattr(m, "cpb", None) is not None]
    if not layers:
        return
    if getattr(model, "dynamic_img_size", False):
        raise ValueError(
            "dynamic_img_size=True changes the token grid per input, but this model's attention has a grid "
            "position bias (cosine); build it for one image size, or with position_bias=False"
        )
    for module in layers:
        module.set_grid_size(tuple(model.patch_embed.grid_size))


def _fill_new_attention_params(state_dict: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Keys of attention parameters the checkpoint lacks (a router for ``moh`` from an MHA
    checkpoint, ...) are taken from the model's initialisation, and logged; others stay missing so
    a strict load names them."""
    prefixes = tuple(f"{name}." for name, _ in attention_modules(model))
    own = model.state_dict()
    missing = [k for k in own if k not in state_dict and k.startswith(prefixes)]
    if missing:
        kinds = sorted({k.split(".", 3)[-1] if k.count(".") >= 3 else k for k in missing})
        log.info(
            "checkpoint has no %d attention parameters (%s); they keep the model's initialisation "
            "(train or continue-tune them)",
            len(missing),
            ", ".join(kinds),
        )
        state_dict = {**state_dict, **{k: own[k] for k in missing}}
    return state_dict


def checkpoint_filter_fn(state_dict: Mapping[str, Any], model: VisionTransformer) -> dict[str, torch.Tensor]:
    """A DeiT / timm ViT / visattn checkpoint -> this model's state dict.

    Unwraps ``{"model": ...}`` / ``{"state_dict": ...}`` (DeiT's ``.pth``), renames the released MoH
    key names (``convert_moh_state_dict``), applies timm's ViT conversion (patch-embedding and
    position-embedding resizing, ``.npz`` names) and fills attention parameters the checkpoint has
    not (routers) from the model's initialisation, with a log line.
    """
    for key in ("model", "state_dict", "model_ema"):
        if key in state_dict and isinstance(state_dict[key], Mapping):
            state_dict = state_dict[key]
            break
    state_dict = convert_moh_state_dict(state_dict)
    state_dict = timm_vit_filter(state_dict, model)
    return _fill_new_attention_params(state_dict, model)


def _create(variant: str, pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    if pretrained:
        require_local_weights(variant, kwargs, "DeiT / timm ViT / visattn weights, .pth or .safetensors")
    # img_size, in_chans and num_classes come from the pretrained config (timm's defaults mechanism)
    skip = ("img_size", "in_chans", "num_classes")
    preset = {k: v for k, v in VIT_PRESETS[variant.removeprefix("visattn_vit_")].items() if k not in skip}
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        vision_transformer,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **{**preset, **kwargs},
    )


def _cfg(preset: str, **overrides: Any) -> dict[str, Any]:
    """timm pretrained config of a preset: input size and channels from the preset, DeiT's
    ImageNet preprocessing unless overridden. No weights are hosted: load a local file."""
    p = VIT_PRESETS[preset]
    size = p["img_size"]
    return {
        "url": "",
        "num_classes": p.get("num_classes", 1000),
        "input_size": (p.get("in_chans", 3), size, size),
        "pool_size": None,
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "fixed_input_size": True,
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "paper_ids": "arXiv:2010.11929",
        "paper_name": "An Image is Worth 16x16 Words: Transformers for Image Recognition at Scale",
        "license": "apache-2.0",
        **overrides,
    }


_MOH_PAPER = dict(paper_ids=("arXiv:2010.11929", "arXiv:2410.11842"))
default_cfgs = generate_default_cfgs(
    {
        "visattn_vit_tiny_patch16_224": _cfg("tiny_patch16_224", **_MOH_PAPER),
        "visattn_vit_small_patch16_224": _cfg("small_patch16_224", **_MOH_PAPER),
        "visattn_vit_base_patch16_224": _cfg("base_patch16_224", **_MOH_PAPER),
        # scikit-learn digits: 1 channel, 8 px, values in [0, 1] (visattn.data normalises to mean 0.5, std 0.5)
        "visattn_vit_tiny_patch2_8": _cfg(
            "tiny_patch2_8", mean=(0.5,), std=(0.5,), crop_pct=1.0, interpolation="bilinear", **_MOH_PAPER
        ),
        # Fashion-MNIST / CIFAR-sized inputs, no centre crop
        "visattn_vit_tiny_patch4_32": _cfg(
            "tiny_patch4_32", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), crop_pct=1.0, interpolation="bilinear",
            **_MOH_PAPER,
        ),
    }
)


@register_model
def visattn_vit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    return _create("visattn_vit_tiny_patch16_224", pretrained, **kwargs)


@register_model
def visattn_vit_small_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    return _create("visattn_vit_small_patch16_224", pretrained, **kwargs)


@register_model
def visattn_vit_base_patch16_224(pretrained: bool = False, **kwargs) -> VisionTransformer:
    return _create("visattn_vit_base_patch16_224", pretrained, **kwargs)


@register_model
def visattn_vit_tiny_patch2_8(pretrained: bool = False, **kwargs) -> VisionTransformer:
    return _create("visattn_vit_tiny_patch2_8", pretrained, **kwargs)


@register_model
def visattn_vit_tiny_patch4_32(pretrained: bool = False, **kwargs) -> VisionTransformer:
    return _create("visattn_vit_tiny_patch4_32", pretrained, **kwargs)
