"""TransNeXt-style hierarchical backbone (Shi, CVPR 2024) with any registered attention in its last
stage and Mixture-of-Head budgets per stage (MoH-ViT, arXiv 2410.11842).

Four stages at strides 4, 8, 16, 32. Each stage: an overlapping convolutional patch embedding
(7x7 stride 4, then 3x3 stride 2; each followed by LayerNorm), blocks of
``x + drop_path(mixer(norm(x)))`` and ``x + drop_path(ConvGLU(norm(x)))``, and a LayerNorm at the
stage end. Stages whose pooling ratio is above 1 mix tokens with ``AggregatedAttention``; the
stage with pooling ratio 1 uses the registered attention named by ``attn`` (default ``cosine``,
TransNeXt's own full attention). Classification: mean pooling over the last stage and a linear
head; no class token.

The model is not tied to one resolution: every position table is built for the feature-map size
it meets (cached per size), so any input whose sides are multiples of 32 works with the same
weights.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from timm.layers import DropPath, trunc_normal_
from timm.models import register_model

from visattn.attention import (
    active_heads,
    build_attention,
    convert_moh_state_dict,
    expand_per_layer,
    parse_attn_spec,
)
from visattn.attention.routing import default_budget

from .aggregated_attention import AggregatedAttention

log = logging.getLogger(__name__)

STRIDE = 32
ROUTING_KEYS = ("shared_heads", "routed_topk", "two_stage", "router", "gate")
DEFAULT_ATTN = "cosine"
# As TransNeXt: no weight decay on temperatures, query embeddings and position biases (their MLPs too).
NO_DECAY_PARTS = {"temperature", "query_embedding", "cpb", "local_bias"}


class OverlapPatchEmbed(nn.Module):
    """Strided convolution with overlap, then LayerNorm. x: [B, C_in, H, W] -> ([B, N, C], (H', W'))."""

    def __init__(self, in_chans: int, dim: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, kernel_size, stride=stride, padding=kernel_size // 2)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        x = self.proj(x)
        hw = (x.shape[2], x.shape[3])
        return self.norm(x.flatten(2).transpose(1, 2)), hw


class ConvGLU(nn.Module):
    """Convolutional GLU channel mixer. x: [B, N, C] on an (H, W) grid -> [B, N, C].

    ``fc1`` makes a gate and a value branch of width ``hidden``; the gate branch goes through a 3x3
    depthwise convolution and GELU before multiplying the value branch.
    """

    def __init__(self, dim: int, hidden: int, drop: float = 0.0) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * hidden)
        self.dwconv = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        B, N, _ = x.shape
        gate, value = self.fc1(x).chunk(2, dim=-1)
        gate = gate.transpose(1, 2).reshape(B, -1, *hw)
        gate = self.act(self.dwconv(gate)).flatten(2).transpose(1, 2)
        return self.drop(self.fc2(self.drop(gate * value)))


def glu_hidden(dim: int, mlp_ratio: float) -> int:
    """ConvGLU width: two thirds of the MLP width it replaces, so parameters match that MLP."""
    return int(2 * mlp_ratio * dim / 3)


class TransNeXtBlock(nn.Module):
    """Pre-norm block: token mixer then ConvGLU. x: [B, N, C] on an (H, W) grid -> [B, N, C]."""

    def __init__(self, dim: int, mixer: nn.Module, mlp_ratio: float, drop: float, drop_path: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = mixer
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = ConvGLU(dim, glu_hidden(dim, mlp_ratio), drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        x = x + self.drop_path(mix_tokens(self.attn, self.norm1(x), hw))
        return x + self.drop_path(self.mlp(self.norm2(x), hw))


def mix_tokens(mixer: nn.Module, x: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """Call a token mixer, first telling it the token grid when it is position-aware."""
    if hasattr(mixer, "set_grid_size"):
        mixer.set_grid_size(hw)
    return mixer(x)


def build_mixer(
    name: str,
    dim: int,
    num_heads: int,
    pool_ratio: int,
    window_size: int,
    stage_kwargs: Mapping[str, Any],
    **common: Any,
) -> nn.Module:
    """Aggregated attention where the stage pools (given the routing kwargs only), else ``name``."""
    if pool_ratio > 1:
        routing = {k: v for k, v in stage_kwargs.items() if k in ROUTING_KEYS}
        return AggregatedAttention(
            dim, num_heads, pool_ratio=pool_ratio, window_size=window_size, **routing, **common
        )
    return build_attention(name, dim, num_heads, **stage_kwargs, **common)


def stage_mixer_specs(
    attn: str | Mapping[str, Any], heads: Sequence[int]
) -> tuple[str, list[dict[str, Any]]]:
    """The full-attention name and one kwargs dict per stage from an attention spec.

    ``moh`` names MoH-ViT: TransNeXt's cosine attention with routing in every stage, each stage
    without a budget getting MoH's default one (half the heads shared, half the pool routed).
    """
    name, kwargs = parse_attn_spec(attn)
    per_stage = expand_per_layer(name, kwargs, len(heads), unit="stage")
    if name == "moh":
        name = DEFAULT_ATTN
        for stage, h in zip(per_stage, heads, strict=True):
            if stage.get("routed_topk") is None:
                stage["shared_heads"], stage["routed_topk"] = default_budget(h, stage.get("shared_heads"))
    return name, per_stage


def stage_heads(embed_dims: Sequence[int], num_heads: int | Sequence[int] | None, head_dim: int) -> list[int]:
    """Heads per stage: given (an int or one per stage), else dim / head_dim."""
    if num_heads is None:
        bad = [dim for dim in embed_dims if dim % head_dim]
        if bad:
            raise ValueError(
                f"embed dims {bad} are not multiples of head_dim={head_dim}; change head_dim or give num_heads"
            )
        return [dim // head_dim for dim in embed_dims]
    heads = [int(num_heads)] * len(embed_dims) if isinstance(num_heads, int) else [int(h) for h in num_heads]
    if len(heads) != len(embed_dims):
        raise ValueError(f"num_heads={heads} needs one entry per stage ({len(embed_dims)}) or a single int")
    return heads


class TransNeXt(nn.Module):
    """Hierarchical vision backbone. x: [B, in_chans, H, W] (H, W multiples of 32) -> logits [B, classes].

    Args:
        embed_dims, depths, mlp_ratios, pool_ratios: one entry per stage.
        num_heads: heads per stage (an int or one per stage); None = dim / head_dim (TransNeXt: 24).
        attn: the full-attention mixer of pool-ratio-1 stages, a registered name or
            ``{"name": ..., **kwargs}``; any kwarg may be a list with one entry per stage. The routing
            kwargs (``shared_heads``, ``routed_topk``, ``two_stage``, ``router``, ``gate``) reach every
            stage, aggregated ones included; the others reach only the full-attention stage. ``moh``
            means MoH-ViT (see ``stage_mixer_specs``).
        in_chans: input channels (3 for images, 4 for SD latents).
        img_size: nominal input size, only for timm's data config; any multiple of 32 runs.
    """

    def __init__(
        self,
        embed_dims: Sequence[int] = (48, 96, 192, 384),
        depths: Sequence[int] = (2, 2, 15, 2),
        mlp_ratios: Sequence[float] = (8, 8, 4, 4),
        pool_ratios: Sequence[int] = (8, 4, 2, 1),
        num_heads: int | Sequence[int] | None = None,
        head_dim: int = 24,
        attn: str | Mapping[str, Any] = DEFAULT_ATTN,
        num_classes: int = 1000,
        in_chans: int = 3,
        img_size: int = 224,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        window_size: int = 3,
    ) -> None:
        super().__init__()
        stages = len(embed_dims)
        for key, value in (("depths", depths), ("mlp_ratios", mlp_ratios), ("pool_ratios", pool_ratios)):
            if len(value) != stages:
                raise ValueError(f"{key}={list(value)} needs one entry per stage ({stages}, as embed_dims)")
        if img_size % STRIDE:
            raise ValueError(
                f"img_size={img_size} is not a multiple of {STRIDE} (TransNeXt downsamples by {STRIDE}); "
                f"use inputs of 32, 64, ..., 224 px (e.g. data.image_size=32)"
            )
        heads = stage_heads(embed_dims, num_heads, head_dim)
        name, per_stage = stage_mixer_specs(attn, heads)
        self.attn_name = name
        self.num_classes = num_classes
        self.embed_dims = list(embed_dims)
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.img_size = img_size

        total = sum(depths)
        rates = [drop_path_rate * i / max(1, total - 1) for i in range(total)]  # linear ramp
        self.patch_embeds = nn.ModuleList()
        self.stages = nn.ModuleList()
        self.stage_norms = nn.ModuleList()
        block_idx = 0
        for i, (dim, depth) in enumerate(zip(embed_dims, depths, strict=True)):
            kernel, stride = (7, 4) if i == 0 else (3, 2)
            self.patch_embeds.append(
                OverlapPatchEmbed(embed_dims[i - 1] if i else in_chans, dim, kernel, stride)
            )
            blocks = []
            for _ in range(depth):
                common = dict(
                    qkv_bias=qkv_bias,
                    attn_drop=attn_drop_rate,
                    proj_drop=drop_rate,
                    layer_idx=block_idx,
                    depth=total,
                )
                try:
                    mixer = build_mixer(
                        name, dim, heads[i], pool_ratios[i], window_size, per_stage[i], **common
                    )
                except (TypeError, ValueError) as err:
                    raise ValueError(
                        f"stage {i + 1} ({heads[i]} heads, attn kwargs {per_stage[i]}): {err}"
                    ) from None
                blocks.append(TransNeXtBlock(dim, mixer, mlp_ratios[i], drop_rate, rates[block_idx]))
                block_idx += 1
            self.stages.append(nn.ModuleList(blocks))
            self.stage_norms.append(nn.LayerNorm(dim, eps=1e-6))
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.apply(_init_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Full names of the attention parameters TransNeXt trains without weight decay."""
        return {name for name, _ in self.named_parameters() if NO_DECAY_PARTS & set(name.split("."))}

    def reset_classifier(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, in_chans, H, W] -> last-stage tokens [B, (H/32) * (W/32), C_4] (normalised)."""
        if x.ndim != 4 or x.shape[2] % STRIDE or x.shape[3] % STRIDE:
            raise ValueError(
                f"input of shape {tuple(x.shape)} must be [B, C, H, W] with H and W multiples of {STRIDE}; "
                f"resize or pad the images"
            )
        B = x.shape[0]
        for i, (embed, blocks, norm) in enumerate(
            zip(self.patch_embeds, self.stages, self.stage_norms, strict=True)
        ):
            x, hw = embed(x)
            for block in blocks:
                x = block(x, hw)
            x = norm(x)
            if i < len(self.stages) - 1:
                x = x.transpose(1, 2).reshape(B, -1, *hw)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(x.mean(dim=1))
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Conv2d):
        fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
        nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


# --- presets -------------------------------------------------------------------------------------

PRESETS: dict[str, dict[str, Any]] = {
    "transnext_micro": {"embed_dims": (48, 96, 192, 384), "depths": (2, 2, 15, 2)},
    "transnext_tiny": {"embed_dims": (72, 144, 288, 576), "depths": (2, 2, 15, 2)},
    "transnext_small": {"embed_dims": (72, 144, 288, 576), "depths": (5, 5, 22, 5)},
    "transnext_base": {"embed_dims": (96, 192, 384, 768), "depths": (5, 5, 23, 5)},
}

# MoH-ViT budgets per stage (MoH release): backbone preset, shared heads, routed top-k.
MOH_PRESETS: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]] = {
    "moh_transnext_small_80": ("transnext_small", (3, 6, 3, 8), (0, 0, 6, 12)),
    "moh_transnext_small_75": ("transnext_small", (3, 6, 3, 4), (0, 0, 6, 12)),
    "moh_transnext_base_75": ("transnext_base", (4, 8, 4, 5), (0, 0, 8, 16)),
    "moh_transnext_base_50": ("transnext_base", (2, 2, 2, 4), (2, 4, 6, 8)),
}


def create_transnext(preset: str, **overrides: Any) -> TransNeXt:
    """Build a preset (``transnext_{micro,tiny,small,base}`` or ``moh_transnext_*``) and log its
    activation ratio; overrides win.

    MoH presets run TransNeXt's cosine attention (or the ``attn`` given) with the published
    per-stage budgets, unless ``attn`` carries a budget of its own.
    """
    if preset not in PRESETS and preset not in MOH_PRESETS:
        raise ValueError(
            f"unknown TransNeXt preset {preset!r}; choose one of {sorted(PRESETS) + sorted(MOH_PRESETS)}"
        )
    if preset in MOH_PRESETS:
        backbone, shared, topk = MOH_PRESETS[preset]
        name, attn_kwargs = parse_attn_spec(overrides.pop("attn", DEFAULT_ATTN))
        if attn_kwargs.get("shared_heads") is None and attn_kwargs.get("routed_topk") is None:
            attn_kwargs.update(shared_heads=list(shared), routed_topk=list(topk))
        model = TransNeXt(**{**PRESETS[backbone], **overrides, "attn": {"name": name, **attn_kwargs}})
    else:
        model = TransNeXt(**{**PRESETS[preset], **overrides})
    active, total = active_heads(model)
    log.info(
        "%s (%s): %d/%d heads active per token (%.1f%%)",
        preset,
        model.attn_name,
        active,
        total,
        100 * active / total,
    )
    return model


# --- released weights ------------------------------------------------------------------------------

_RELEASED_STAGE = re.compile(r"^(patch_embed|block|norm)([1-9])\.(.+)$")
_RELEASED_RENAMES = (
    (".mlp.dwconv.dwconv.", ".mlp.dwconv."),
    (".attn.cpb_fc1.", ".attn.cpb.fc1."),
    (".attn.cpb_fc2.", ".attn.cpb.fc2."),
    (".attn.norm.", ".attn.pool_norm."),
    (".attn.relative_pos_bias_local", ".attn.local_bias"),
)


def convert_transnext_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map the released TransNeXt / MoH-ViT key names to ours (MoH routers via
    ``convert_moh_state_dict``): ``block{i}.{j}`` -> ``stages.{i-1}.{j}``, ``patch_embed{i}`` ->
    ``patch_embeds.{i-1}``, ``norm{i}`` -> ``stage_norms.{i-1}``, separate ``q`` / ``kv`` projections ->
    one ``qkv``, ``relative_pos_bias_local`` -> ``local_bias``. Keys already in our layout pass unchanged.

    The release measures position-bias offsets in units of its pre-training grid, ours in grid cells,
    so the loaded position-bias MLPs see other inputs than they were trained on: fine-tune briefly.
    """
    out: dict[str, torch.Tensor] = {}
    split_q: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in convert_moh_state_dict(state_dict).items():
        m = _RELEASED_STAGE.match(key)
        if m:
            kind, stage, rest = m.group(1), int(m.group(2)) - 1, m.group(3)
            prefix = {"patch_embed": "patch_embeds", "block": "stages", "norm": "stage_norms"}[kind]
            key = f"{prefix}.{stage}.{rest}"
        for old, new in _RELEASED_RENAMES:
            key = key.replace(old, new)
        if key.endswith(".attn.local_bias") and value.ndim == 2:
            value = value.unsqueeze(1)  # [heads, window^2] -> [heads, 1, window^2]
        q_or_kv = re.match(r"^(.+\.attn)\.(q|kv)\.(weight|bias)$", key)
        if q_or_kv:
            split_q.setdefault(f"{q_or_kv.group(1)}.qkv.{q_or_kv.group(3)}", {})[q_or_kv.group(2)] = value
            continue
        out[key] = value
    for key, parts in split_q.items():
        if set(parts) != {"q", "kv"}:
            raise ValueError(f"{key}: the weight file has only {sorted(parts)} of the q and kv projections")
        out[key] = torch.cat([parts["q"], parts["kv"]], dim=0)
    return out


def _timm_entry(preset: str):
    def entry(pretrained: bool = False, **kwargs: Any) -> TransNeXt:
        if pretrained:
            raise ValueError(
                f"visattn_{preset} has no published weights to download; build it with pretrained=False "
                "and load a local checkpoint with visattn.utils.checkpoint.load_weights"
            )
        for key in ("pretrained_cfg", "pretrained_cfg_overlay", "cache_dir"):
            kwargs.pop(key, None)
        model = create_transnext(preset, **kwargs)
        model.pretrained_cfg = model.default_cfg = {
            "architecture": f"visattn_{preset}",
            "num_classes": model.num_classes,
            "input_size": (model.patch_embeds[0].proj.in_channels, model.img_size, model.img_size),
            "interpolation": "bicubic",
            "crop_pct": 0.875,
            "mean": (0.485, 0.456, 0.406),
            "std": (0.229, 0.224, 0.225),
            "first_conv": "patch_embeds.0.proj",
            "classifier": "head",
        }
        return model

    entry.__name__ = f"visattn_{preset}"
    entry.__doc__ = f"TransNeXt preset {preset!r} (see visattn.models.transnext.create_transnext)."
    return entry


for _preset in (*PRESETS, *MOH_PRESETS):
    register_model(_timm_entry(_preset))
