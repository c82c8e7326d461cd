"""TransNeXt-style hierarchical backbone (Shi, CVPR 2024) with any registered attention in its last
stage and Mixture-of-Head budgets per stage (MoH-ViT, arXiv 2410.11842), as a timm model.

Four stages at strides 4, 8, 16, 32. Each stage (``stages.{i}``): an overlapping convolutional patch
embedding (7x7 stride 4, then 3x3 stride 2; each followed by LayerNorm), blocks of
``x + drop_path(mixer(norm(x)))`` and ``x + drop_path(ConvGLU(norm(x)))``, and a LayerNorm at the
stage end; a stage maps [B, C_in, H, W] to [B, C, H / 2, W / 2] (the first to H / 4). Stages whose
pooling ratio is above 1 mix tokens with ``AggregatedAttention``; the stage with pooling ratio 1 uses
the registered attention named by ``attn`` (default ``cosine``, TransNeXt's own full attention).
Classification: global average pooling of the last stage's map and a linear head; no class token.

The model is not tied to one resolution: position tables are built for the grid each call meets, so
any input whose sides are multiples of 32 works with the same weights. Position-bias offsets are
scaled by the token grid of pre-training, ``pretrain_size`` (pixels; default ``img_size``), exactly as
the released TransNeXt / MoH-ViT code does: to run released 224 px weights at 384 px, build with
``img_size=384, pretrain_size=224``.

timm: ``timm.create_model("visattn_transnext_micro", pretrained=True,
pretrained_cfg_overlay=dict(file=PATH))`` loads a released (or our) checkpoint through
``checkpoint_filter_fn``; ``features_only=True`` gives the four stage maps; ``forward_intermediates``,
``prune_intermediate_layers``, ``set_grad_checkpointing``, torch.fx tracing and ``torch.jit.script``
work as for timm's own hierarchical models.
"""


import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, get_device_dtype, register_notrace_function, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from timm.models._manipulate import checkpoint

from visattn.attention import (
    active_heads,
    build_attention,
    convert_moh_state_dict,
    expand_per_layer,
    get_attention_class,
    parse_attn_spec,
)
from visattn.attention.cosine import CosineAttention
from visattn.attention.routing import default_budget
from visattn.models.budgets import get_budget
from visattn.models.pretrained import require_local_weights

from .aggregated_attention import AggregatedAttention

log = logging.getLogger(__name__)

STRIDE = 32
ROUTING_KEYS = ("shared_heads", "routed_topk", "two_stage", "router", "gate")
DEFAULT_ATTN = "cosine"
GLOBAL_POOLS = ("avg", "max", "")
# As TransNeXt: no weight decay on temperatures, query embeddings and position biases (their MLPs too).
NO_DECAY_PARTS = {"temperature", "query_embedding", "cpb", "local_bias"}


@register_notrace_function  # a leaf for torch.fx: checks runtime shapes
def check_input(x: torch.Tensor) -> torch.Tensor:
    """x: [B, C, H, W] with H and W multiples of 32, returned unchanged; else ValueError."""
    if x.dim() != 4 or x.shape[2] % 32 != 0 or x.shape[3] % 32 != 0:
        raise ValueError(
            "input of shape " + str(list(x.shape)) + " must be [B, C, H, W] with H and W multiples of 32; "
            "resize or pad the images"
        )
    return x


torch.fx.wrap("check_input")  # a leaf for plain torch.fx.symbolic_trace too


class OverlapPatchEmbed(nn.Module):
    """Strided convolution with overlap, then LayerNorm. x: [B, C_in, H, W] -> ([B, N, C], (H', W'))."""

    def __init__(self, in_chans: int, dim: int, kernel_size: int, stride: int, device=None, dtype=None) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.proj = nn.Conv2d(in_chans, dim, kernel_size, stride=stride, padding=kernel_size // 2, **dd)
        self.norm = nn.LayerNorm(dim, **dd)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        x = self.proj(x)
        grid_size = (x.shape[2], x.shape[3])
        return self.norm(x.flatten(2).transpose(1, 2)), grid_size


class ConvGLU(nn.Module):
    """Convolutional GLU channel mixer. x: [B, N, C] on an (H, W) grid -> [B, N, C].

    ``fc1`` makes a gate and a value branch of width ``hidden``; the gate branch goes through a 3x3
    depthwise convolution and GELU before multiplying the value branch.
    """

    def __init__(self, dim: int, hidden: int, drop: float = 0.0, device=None, dtype=None) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.fc1 = nn.Linear(dim, 2 * hidden, **dd)
        self.dwconv = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, **dd)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim, **dd)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
        B, N, _ = x.shape
        gate, value = self.fc1(x).chunk(2, dim=-1)
        gate = gate.transpose(1, 2).reshape(B, -1, grid_size[0], grid_size[1])
        gate = self.act(self.dwconv(gate)).flatten(2).transpose(1, 2)
        return self.drop(self.fc2(self.drop(gate * value)))


def glu_hidden(dim: int, mlp_ratio: float) -> int:
    """ConvGLU width: two thirds of the MLP width it replaces, so parameters match that MLP."""
    return int(2 * mlp_ratio * dim / 3)


class TransNeXtBlock(nn.Module):
    """Pre-norm block: token mixer then ConvGLU. x: [B, N, C] on an (H, W) grid -> [B, N, C].

    This class calls its mixer as ``attn(x)``; the subclasses give the mixer the grid.
    """

    def __init__(
        self, dim: int, mixer: nn.Module, mlp_ratio: float, drop: float, drop_path: float, device=None, dtype=None
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, **dd)
        self.attn = mixer
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, **dd)
        self.mlp = ConvGLU(dim, glu_hidden(dim, mlp_ratio), drop, **dd)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def mix(self, x: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
        return self.attn(x)

    def forward(self, x: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
        x = x + self.drop_path(self.mix(self.norm1(x), grid_size))
        return x + self.drop_path(self.mlp(self.norm2(x), grid_size))


class AggregatedBlock(TransNeXtBlock):
    """Block whose mixer is ``AggregatedAttention`` (takes the grid with each call)."""

    def mix(self, x: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
        return self.attn.forward_grid(x, grid_size)


class PositionBiasBlock(TransNeXtBlock):
    """Block whose full-attention mixer has a continuous position bias (``cosine``): the bias of this
    grid goes in as the additive attention mask, so the mixer keeps no grid state."""

    def mix(self, x: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
        return self.attn(x, attn_mask=self.attn.cpb(grid_size, grid_size))


def make_block(dim: int, mixer: nn.Module, *args: Any, **kwargs: Any) -> TransNeXtBlock:
    """The block class that feeds ``mixer`` its grid."""
    if isinstance(mixer, AggregatedAttention):
        return AggregatedBlock(dim, mixer, *args, **kwargs)
    if isinstance(mixer, CosineAttention) and mixer.cpb is not None:
        return PositionBiasBlock(dim, mixer, *args, **kwargs)
    return TransNeXtBlock(dim, mixer, *args, **kwargs)


class TransNeXtStage(nn.Module):
    """Patch embedding, blocks, LayerNorm. x: [B, C_in, H, W] -> [B, C, H / stride, W / stride]."""

    def __init__(
        self, patch_embed: OverlapPatchEmbed, blocks: Sequence[TransNeXtBlock], dim: int, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.patch_embed = patch_embed
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(dim, eps=1e-6, device=device, dtype=dtype)
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        x, grid_size = self.patch_embed(x)
        for block in self.blocks:
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(block, x, grid_size)
            else:
                x = block(x, grid_size)
        x = self.norm(x)
        return x.transpose(1, 2).reshape(B, -1, grid_size[0], grid_size[1])


def build_mixer(
    name: str,
    dim: int,
    num_heads: int,
    pool_ratio: int,
    window_size: int,
    stage_kwargs: Mapping[str, Any],
    pretrain_grid: tuple[int, int],
    **common: Any,
) -> nn.Module:
    """Aggregated attention where the stage pools (given the routing kwargs only), else ``name``.

    Mixers with a continuous position bias get the stage's pre-training token grid ``pretrain_grid``.
    """
    if pool_ratio > 1:
        routing = {k: v for k, v in stage_kwargs.items() if k in ROUTING_KEYS}
        return AggregatedAttention(
            dim, num_heads, pool_ratio=pool_ratio, window_size=window_size, pretrain_size=pretrain_grid,
            **routing, **common,
        )
    if issubclass(get_attention_class(name), CosineAttention):
        common = {"pretrain_size": pretrain_grid, **common}
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


def _pair(size: int | Sequence[int], key: str) -> tuple[int, int]:
    pair = (int(size), int(size)) if isinstance(size, int) else tuple(int(s) for s in size)
    if len(pair) != 2 or min(pair) < 1:
        raise ValueError(f"{key}={size!r} must be a positive int or (height, width)")
    return pair


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
        img_size: nominal input size (int or (H, W)), for the data config and ``pretrain_size``'s
            default; any multiple of 32 runs.
        pretrain_size: input size (pixels) the weights were pre-trained at; position-bias offsets are
            scaled by its token grid per stage, as the release. None = ``img_size``.
        global_pool: ``"avg"`` (default), ``"max"`` or ``""`` (``forward`` then returns the last map).
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
        img_size: int | Sequence[int] = 224,
        pretrain_size: int | Sequence[int] | None = None,
        global_pool: str = "avg",
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        window_size: int = 3,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        stages = len(embed_dims)
        for key, value in (("depths", depths), ("mlp_ratios", mlp_ratios), ("pool_ratios", pool_ratios)):
            if len(value) != stages:
                raise ValueError(f"{key}={list(value)} needs one entry per stage ({stages}, as embed_dims)")
        img_size = _pair(img_size, "img_size")
        if img_size[0] % STRIDE or img_size[1] % STRIDE:
            raise ValueError(
                f"img_size={img_size} is not a multiple of {STRIDE} (TransNeXt downsamples by {STRIDE}); "
                f"use inputs of 32, 64, ..., 224 px (e.g. data.image_size=32)"
            )
        pretrain_size = img_size if pretrain_size is None else _pair(pretrain_size, "pretrain_size")
        if global_pool not in GLOBAL_POOLS:
            raise ValueError(f"global_pool={global_pool!r} is not supported; use one of {GLOBAL_POOLS}")
        heads = stage_heads(embed_dims, num_heads, head_dim)
        name, per_stage = stage_mixer_specs(attn, heads)
        self.attn_name = name
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.embed_dims = list(embed_dims)
        self.num_features = self.head_hidden_size = embed_dims[-1]
        self.img_size = img_size
        self.pretrain_size = pretrain_size

        total = sum(depths)
        rates = [drop_path_rate * i / max(1, total - 1) for i in range(total)]  # linear ramp
        self.feature_info: list[dict[str, Any]] = []
        stage_list = []
        block_idx = 0
        for i, (dim, depth) in enumerate(zip(embed_dims, depths, strict=True)):
            reduction = 4 * 2**i
            kernel, stride = (7, 4) if i == 0 else (3, 2)
            embed = OverlapPatchEmbed(embed_dims[i - 1] if i else in_chans, dim, kernel, stride, **dd)
            pretrain_grid = (max(1, pretrain_size[0] // reduction), max(1, pretrain_size[1] // reduction))
            blocks = []
            for _ in range(depth):
                common = dict(
                    qkv_bias=qkv_bias,
                    attn_drop=attn_drop_rate,
                    proj_drop=drop_rate,
                    layer_idx=block_idx,
                    depth=total,
                    **dd,
                )
                try:
                    mixer = build_mixer(
                        name, dim, heads[i], pool_ratios[i], window_size, per_stage[i], pretrain_grid, **common
                    )
                except (TypeError, ValueError) as err:
                    raise ValueError(
                        f"stage {i + 1} ({heads[i]} heads, attn kwargs {per_stage[i]}): {err}"
                    ) from None
                blocks.append(make_block(dim, mixer, mlp_ratios[i], drop_rate, rates[block_idx], **dd))
                block_idx += 1
            stage_list.append(TransNeXtStage(embed, blocks, dim, **dd))
            self.feature_info.append(dict(num_chs=dim, reduction=reduction, module=f"stages.{i}"))
        self.stages = nn.Sequential(*stage_list)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.num_features, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.apply(_init_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Full names of the attention parameters TransNeXt trains without weight decay."""
        return {name for name, _ in self.named_parameters() if NO_DECAY_PARTS & set(name.split("."))}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        blocks = r"^stages\.(\d+)" if coarse else [
            (r"^stages\.(\d+)\.blocks\.(\d+)", None),
            (r"^stages\.(\d+)\.norm", (99999,)),
        ]
        return dict(stem=r"^stages\.0\.patch_embed", blocks=blocks)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.stages:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """New head for ``num_classes`` (0: none); ``global_pool`` None keeps the current pooling."""
        if global_pool is not None:
            if global_pool not in GLOBAL_POOLS:
                raise ValueError(f"global_pool={global_pool!r} is not supported; use one of {GLOBAL_POOLS}")
            self.global_pool = global_pool
        self.num_classes = num_classes
        dd = get_device_dtype(self)
        self.head = nn.Linear(self.num_features, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.head.train(self.training)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """Stage maps [B, C_i, H / r_i, W / r_i] (each after its stage's LayerNorm, which belongs to the
        stage; ``norm`` changes nothing). ``indices``: the last n stages if an int, all if None, else
        those listed. Returns (final map, maps), or the maps alone with ``intermediates_only``."""
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt={output_fmt!r}: TransNeXt's intermediates are 'NCHW'")
        intermediates = []
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        x = check_input(x)
        if torch.jit.is_scripting() or not stop_early:  # can't slice stages in torchscript
            stages = self.stages
        else:
            stages = self.stages[: max_index + 1]
        for idx, stage in enumerate(stages):
            x = stage(x)
            if idx in take_indices:
                intermediates.append(x)
        if intermediates_only:
            return intermediates
        return x, intermediates

    @torch.jit.ignore
    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """Drop the stages after the last of ``indices``; returns the kept indices."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        prune_end = max_index < len(self.stages) - 1
        self.stages = self.stages[: max_index + 1]
        if prune_end:
            self.num_features = self.head_hidden_size = self.feature_info[max_index]["num_chs"]
        if prune_head or prune_end:
            self.reset_classifier(0, "")
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, in_chans, H, W] -> last stage map [B, C_4, H / 32, W / 32] (normalised)."""
        return self.stages(check_input(x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """x: [B, C, h, w] -> logits [B, classes] (pooled features [B, C] with ``pre_logits``)."""
        if self.global_pool == "avg":
            x = x.mean(dim=(2, 3))
        elif self.global_pool == "max":
            x = x.amax(dim=(2, 3))
        x = self.head_drop(x)
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
# preset -> (backbone, published budget in visattn.models.budgets, the one home of head budgets)
MOH_PRESETS: dict[str, tuple[str, str]] = {
    "moh_transnext_small_80": ("transnext_small", "MoH-ViT-S-80"),
    "moh_transnext_small_75": ("transnext_small", "MoH-ViT-S-75"),
    "moh_transnext_base_75": ("transnext_base", "MoH-ViT-B-75"),
    "moh_transnext_base_50": ("transnext_base", "MoH-ViT-B-50"),
}


def preset_kwargs(preset: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor keywords of a preset with ``overrides`` winning (MoH presets: the published budget
    unless ``attn`` carries one of its own)."""
    if preset not in PRESETS and preset not in MOH_PRESETS:
        raise ValueError(
            f"unknown TransNeXt preset {preset!r}; choose one of {sorted(PRESETS) + sorted(MOH_PRESETS)}"
        )
    overrides = dict(overrides)
    if preset not in MOH_PRESETS:
        return {**PRESETS[preset], **overrides}
    backbone, budget_name = MOH_PRESETS[preset]
    name, attn_kwargs = parse_attn_spec(overrides.pop("attn", DEFAULT_ATTN))
    if attn_kwargs.get("shared_heads") is None and attn_kwargs.get("routed_topk") is None:
        budget = get_budget(budget_name)
        attn_kwargs.update(shared_heads=list(budget.shared_heads), routed_topk=list(budget.routed_topk))
    return {**PRESETS[backbone], **overrides, "attn": {"name": name, **attn_kwargs}}


def log_activation(model: TransNeXt, preset: str) -> None:
    active, total = active_heads(model)
    log.info(
        "%s (%s): %d/%d heads active per token (%.1f%%)", preset, model.attn_name, active, total,
        100 * active / total,
    )


def create_transnext(preset: str, **overrides: Any) -> TransNeXt:
    """Build a preset (``transnext_{micro,tiny,small,base}`` or ``moh_transnext_*``) and log its
    activation ratio; overrides win. For timm's interface (pretrained files, ``features_only``) use
    ``timm.create_model(f"visattn_{preset}", ...)``.

    MoH presets run TransNeXt's cosine attention (or the ``attn`` given) with the published
    per-stage budgets, unless ``attn`` carries a budget of its own.
    """
    model = TransNeXt(**preset_kwargs(preset, overrides))
    log_activation(model, preset)
    return model


# --- released weights ------------------------------------------------------------------------------

_RELEASED_STAGE = re.compile(r"^(patch_embed|block|norm)([1-9])\.(.+)$")
_OLD_LAYOUT = (  # visattn before stage modules: patch_embeds.i / stages.i.j / stage_norms.i
    (re.compile(r"^patch_embeds\.(\d+)\.(.+)$"), r"stages.\1.patch_embed.\2"),
    (re.compile(r"^stages\.(\d+)\.(\d+)\.(.+)$"), r"stages.\1.blocks.\2.\3"),
    (re.compile(r"^stage_norms\.(\d+)\.(.+)$"), r"stages.\1.norm.\2"),
)
_RELEASED_RENAMES = (
    (".mlp.dwconv.dwconv.", ".mlp.dwconv."),
    (".attn.cpb_fc1.", ".attn.cpb.fc1."),
    (".attn.cpb_fc2.", ".attn.cpb.fc2."),
    (".attn.norm.", ".attn.pool_norm."),
    (".attn.relative_pos_bias_local", ".attn.local_bias"),
)


def convert_transnext_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map the released TransNeXt / MoH-ViT key names to ours (MoH routers via
    ``convert_moh_state_dict``): ``patch_embed{i}`` -> ``stages.{i-1}.patch_embed``, ``block{i}.{j}`` ->
    ``stages.{i-1}.blocks.{j}``, ``norm{i}`` -> ``stages.{i-1}.norm``, separate ``q`` / ``kv``
    projections -> one ``qkv``, ``relative_pos_bias_local`` -> ``local_bias``. Checkpoints of earlier
    visattn versions (``patch_embeds.i``, ``stages.i.j``, ``stage_norms.i``) are mapped too; keys
    already in our layout pass unchanged.

    Position-bias offsets match the release when the model's ``pretrain_size`` is the checkpoint's
    pre-training size (224 for the published ImageNet-1K weights; the default at ``img_size=224``).
    """
    out: dict[str, torch.Tensor] = {}
    split_q: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in convert_moh_state_dict(state_dict).items():
        m = _RELEASED_STAGE.match(key)
        if m:
            kind, stage, rest = m.group(1), int(m.group(2)) - 1, m.group(3)
            part = {"patch_embed": "patch_embed", "block": "blocks", "norm": "norm"}[kind]
            key = f"stages.{stage}.{part}.{rest}"
        for pattern, replacement in _OLD_LAYOUT:
            key = pattern.sub(replacement, key)
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


def checkpoint_filter_fn(state_dict: Mapping[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    """timm's pretrained filter: unwrap ``{"model": ...}`` / ``{"state_dict": ...}`` and convert the keys."""
    for wrapper in ("model", "state_dict"):
        if isinstance(state_dict.get(wrapper), Mapping):
            state_dict = state_dict[wrapper]
    return convert_transnext_state_dict(state_dict)


# --- timm registration -----------------------------------------------------------------------------

RELEASE_URLS = {
    "transnext": "https://github.com/DaiShiResearch/TransNeXt",
    "moh": "https://github.com/SkyworkAI/MoH",
}


def _cfg(preset: str) -> dict[str, Any]:
    moh = preset.startswith("moh_")
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": (7, 7),
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": "stages.0.patch_embed.proj",
        "classifier": "head",
        "fixed_input_size": False,
        "min_input_size": (3, 32, 32),
        "license": "apache-2.0",
        "paper_ids": "arXiv:2410.11842" if moh else "arXiv:2311.17132",
        "paper_name": "MoH: Multi-Head Attention as Mixture-of-Head Attention" if moh
        else "TransNeXt: Robust Foveal Visual Perception for Vision Transformers",
        "origin_url": RELEASE_URLS["moh" if moh else "transnext"],
        "notes": ("No weights to download: load a released or own checkpoint with "
                  "pretrained=True, pretrained_cfg_overlay=dict(file=PATH).",),
    }


default_cfgs = generate_default_cfgs({f"visattn_{p}": _cfg(p) for p in (*PRESETS, *MOH_PRESETS)})


def _data_cfg_overlay(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The data config of the size and channels asked for (timm's data pipeline reads it)."""
    if "img_size" not in kwargs and "in_chans" not in kwargs:
        return {}
    h, w = _pair(kwargs.get("img_size", 224), "img_size")
    return {"input_size": (int(kwargs.get("in_chans", 3)), h, w), "pool_size": (h // STRIDE, w // STRIDE)}


def create_timm_transnext(preset: str, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """timm entry point of a preset: ``build_model_with_cfg`` with our config, pretrained files
    through ``checkpoint_filter_fn``, ``features_only`` through ``forward_intermediates``."""
    variant = f"visattn_{preset}"
    if pretrained:
        require_local_weights(variant, kwargs, "a released TransNeXt / MoH-ViT .pth or a visattn .safetensors")
    overlay = {**_data_cfg_overlay(kwargs), **(kwargs.pop("pretrained_cfg_overlay", None) or {})}
    out_indices = kwargs.pop("out_indices", (0, 1, 2, 3))
    model_kwargs = preset_kwargs(preset, kwargs)
    model = build_model_with_cfg(
        TransNeXt,
        variant,
        pretrained,
        pretrained_cfg_overlay=overlay or None,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **model_kwargs,
    )
    log_activation(model.model if hasattr(model, "model") else model, preset)
    return model


def _timm_entry(preset: str):
    def entry(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        return create_timm_transnext(preset, pretrained, **kwargs)

    entry.__name__ = entry.__qualname__ = f"visattn_{preset}"
    entry.__doc__ = f"TransNeXt preset {preset!r} (see visattn.models.transnext.create_timm_transnext)."
    return entry


for _preset in (*PRESETS, *MOH_PRESETS):
    register_model(_timm_entry(_preset))
