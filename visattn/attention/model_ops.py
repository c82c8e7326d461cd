"""Model-wide operations: collect routing losses, head counts and statistics, swap attention in
timm models, and rename the released MoH checkpoints' keys."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from timm.layers import Attention as TimmAttention

from .base import HeadAttention
from .impl_probe import device_name
from .registry import attention_keywords, build_attention, get_attention_class
from .spec import expand_per_layer

log = logging.getLogger(__name__)

PerLayer = Sequence[Mapping[str, Any]] | Callable[[int], Mapping[str, Any]] | None


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every attention layer in forward order: ours and timm's ``Attention``."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (HeadAttention, TimmAttention))]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Mean load-balancing loss over the layers that routed in their last training forward
    (a zero scalar when none did). The training loss adds ``beta * aux_loss(model)``."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, HeadAttention) and m.aux_loss is not None]
    if not losses:
        param = next(model.parameters(), None)
        return torch.zeros((), device=param.device if param is not None else None)
    return torch.stack([loss.float() for loss in losses]).mean()


def active_heads(model: nn.Module) -> tuple[int, int]:
    """(heads active per token, heads), each summed over the model's attention layers."""
    active = total = 0
    for _, m in attention_modules(model):
        a, t = m.active_heads if isinstance(m, HeadAttention) else (m.num_heads, m.num_heads)
        active += a
        total += t
    return active, total


def attention_stats(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    """Per layer, the statistics of its last forward (e.g. ``head_load``: [B, H] fraction of each
    sample's tokens that used each head)."""
    return [dict(m.stats) for _, m in attention_modules(model) if isinstance(m, HeadAttention)]


def impl_choices(model: nn.Module) -> dict[str, Any]:
    """The run record of which path each attention layer runs, JSON-able:
    ``{"device": <this process's CPU, and GPU if the model is on one>, "layers": [...]}`` with one
    entry per attention layer in forward order: ``layer`` (its module name), ``impl`` (its setting,
    None for variants with a single path), ``path`` (the path of its last forward that could leave
    the dense one; ``"masked_dense"`` / ``"dense"`` otherwise), ``choices`` (per input shape and
    dtype seen: the path, the device it was chosen on, ``source``, the probe's best times in ms and each
    path's time over the masked dense one's, the median of the probe's rounds)
    and, for MoH layers, ``train_path`` (what training takes: the named path, or under ``auto`` the
    layer's ``train_path``); ``train_attention`` (``sdpa`` or ``small_attention``, what a softmax layer's attention
    trains on; None for other layers). Only eval forwards of ``impl="auto"`` layers probe; call it after
    evaluation."""
    param = next(model.parameters(), None)
    devices = [device_name("cpu")]
    if param is not None and param.device.type != "cpu":
        devices.append(device_name(param.device))
    layers = []
    for name, module in attention_modules(model):
        path_log = getattr(module, "path_log", None)
        train_attention = getattr(module, "train_attention", None)
        if path_log is None:
            layers.append({"layer": name, "impl": getattr(module, "impl", None), "path": "dense", "choices": {},
                           "train_attention": train_attention})
            continue
        last = module.last_path or (module.fixed_path or "masked_dense")
        choices = {key: choice.record() for key, choice in path_log.items()}
        layers.append({"layer": name, "impl": module.impl, "path": last, "choices": choices,
                       "train_path": module.fixed_path or module.train_path, "train_attention": train_attention})
    return {"device": " + ".join(devices), "layers": layers}


def _layer_kwargs(per_layer: PerLayer, idx: int, depth: int) -> dict[str, Any]:
    if per_layer is None:
        return {}
    if callable(per_layer):
        return dict(per_layer(idx))
    if len(per_layer) != depth:
        raise ValueError(f"per_layer has {len(per_layer)} entries but the model has {depth} attention layers")
    return dict(per_layer[idx])


def _timm_config(old: nn.Module) -> dict[str, Any]:
    """Constructor keywords that rebuild ``old`` (timm's Attention or ours) with the same shapes."""
    cfg: dict[str, Any] = {
        "num_heads": old.num_heads,
        "head_dim": old.head_dim,
        "dim_out": old.proj.out_features,
        "qkv_bias": old.qkv.bias is not None,
        "proj_bias": old.proj.bias is not None,
        "attn_drop": old.attn_drop.p,
        "proj_drop": old.proj_drop.p,
        "gated": getattr(old, "gate", None) is not None,
    }
    if not isinstance(old.q_norm, nn.Identity):
        cfg.update(qk_norm=True, norm_layer=type(old.q_norm))
    if not isinstance(old.norm, nn.Identity):
        cfg.update(scale_norm=True, norm_layer=type(old.norm))
    return cfg


def swap_attention(
    model: nn.Module, name: str, per_layer: PerLayer = None, *, warn_unkept: bool = True, **kwargs
) -> nn.Module:
    """Replace every attention layer of a timm model (timm's ``Attention`` or ours) by ``name``.

    Weights are copied wherever names and shapes agree (qkv, proj, norms), so swapping ``mha`` leaves
    the model's outputs unchanged and swapping ``moh`` keeps the pretrained projections; new
    parameters (routers) keep their fresh initialisation, and a warning names any weight whose shape
    changed (e.g. ``qkv`` when swapping to ``gqa``/``mqa``), which is not kept. A keyword given
    as a list has one value per attention layer (``shared_heads=[2, 2, 3, ...]``), as in our models'
    specs; ``per_layer`` gives extra keywords per layer: a list with one dict per attention layer, or
    a callable ``layer_idx -> dict``. ``warn_unkept=False`` silences the warning (for freshly built models,
    whose weights are initialised after the swap anyway). Variants that bias a token grid (``cosine``)
    get the model's ``num_prefix_tokens`` (a timm ViT's class and register tokens), so an input whose
    grid no longer matches is refused rather than biased at the wrong tokens. A model with no such layer (EVA, BEiT, Swin
    and CaiT have attention classes of their own) is refused with a ValueError, not returned unchanged.
    """
    get_attention_class(name)  # fail on an unknown name before touching the model
    layers = attention_modules(model)
    if not layers:
        others = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "num_heads")})
        found = f"its attention ({', '.join(others)}) is not one of them" if others else "it has no attention layers"
        raise ValueError(
            f"swap_attention({name!r}) found no attention layer to replace in this {type(model).__name__}: it "
            f"replaces timm.layers.Attention (timm's VisionTransformer, DeiT) and visattn's modules, and {found}; "
            "use such a model, or build one with the attention you want (timm.create_model('visattn_vit_...', attn=...))"
        )
    fixed = sorted({type(m).__name__ for _, m in layers if not getattr(m, "swappable", True)})
    if fixed:
        raise ValueError(
            f"this model's {', '.join(fixed)} layers are part of its design and cannot be swapped; "
            "build the model with the attention you want instead (e.g. create_transnext(..., attn=...))"
        )
    depth = len(layers)
    layer_kwargs = expand_per_layer(name, kwargs, depth)
    # a timm ViT's class and register tokens, for variants that bias a token grid behind them (cosine)
    prefix = getattr(model, "num_prefix_tokens", None) if "num_prefix_tokens" in attention_keywords(name) else None
    reshaped: dict[str, str] = {}  # parameter -> "old shape -> new shape", for the warning below
    for idx, (path, old) in enumerate(layers):
        cfg = {**_timm_config(old), **layer_kwargs[idx], **_layer_kwargs(per_layer, idx, depth)}
        cfg.setdefault("layer_idx", idx)
        cfg.setdefault("depth", depth)
        if prefix is not None:
            cfg.setdefault("num_prefix_tokens", prefix)
        ref = old.qkv.weight
        new = build_attention(name, old.qkv.in_features, device=ref.device, dtype=ref.dtype, **cfg)
        own = new.state_dict()
        copied = {k: v for k, v in old.state_dict().items() if k in own and own[k].shape == v.shape}
        for k, v in old.state_dict().items():
            if k in own and own[k].shape != v.shape:
                reshaped.setdefault(k, f"{tuple(v.shape)} -> {tuple(own[k].shape)}")
        new.load_state_dict(copied, strict=False)
        new.train(old.training)
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, child, new)
    if reshaped and warn_unkept:
        log.warning(
            "swap_attention(%r): %s changed shape, so these weights were NOT kept (they are freshly "
            "initialised; train them or choose keywords that keep the shapes)",
            name,
            ", ".join(f"{k} {shapes}" for k, shapes in reshaped.items()),
        )
    return model


_RELEASED_NAMES = {
    "wg": "router.routed",
    "wg_0": "router.mix",
    "wg_1": "router.shared",
    "cpb_fc1": "cpb.fc1",  # MoH-ViT's continuous position bias MLP
    "cpb_fc2": "cpb.fc2",
}
_RELEASED_KEY = re.compile(r"(^|\.)(wg|wg_0|wg_1|cpb_fc1|cpb_fc2)\.(weight|bias)$")


def convert_moh_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename the released MoH code's module names to ours, under any prefix: routers ``wg``,
    ``wg_0``, ``wg_1`` -> ``router.routed``, ``router.mix``, ``router.shared``, and MoH-ViT's
    ``cpb_fc1``/``cpb_fc2`` -> ``cpb.fc1``/``cpb.fc2``. Other keys pass unchanged."""

    def rename(key: str) -> str:
        m = _RELEASED_KEY.search(key)
        if m is None:
            return key
        return key[: m.start(2)] + _RELEASED_NAMES[m.group(2)] + "." + m.group(3)

    return {rename(k): v for k, v in state_dict.items()}
