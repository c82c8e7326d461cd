"""Diffusion Transformer (DiT, Peebles & Xie 2023) with attention from the visattn registry.

A DiT denoises a noisy image (pixels or VAE latents) ``x: [B, C, H, W]`` given a diffusion step
``t: [B]`` and a class label ``y: [B]`` and returns ``[B, 2C, H, W]`` (noise prediction and, with
``learn_sigma``, the variance interpolation values) or ``[B, C, H, W]``.

The network: patchify -> add fixed 2-D sin-cos positions -> ``depth`` adaLN-Zero blocks conditioned
on ``c = t_emb + y_emb`` -> adaLN final layer -> unpatchify. The modulation layers and the final
projection start at zero, so a fresh model outputs exactly 0 and every block starts as identity.
With ``attn="mha"`` the parameter names and shapes are those of the original release, so its
checkpoints load strictly.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from timm.layers import Mlp, PatchEmbed

from visattn.attention import build_attention, expand_per_layer, parse_attn_spec, per_layer_values
from visattn.models.budgets import HeadBudget, apply_budget, get_budget, list_budgets

BudgetSpec = str | Mapping[str, Any] | HeadBudget | None

TIMESTEP_FREQUENCIES = 256  # width of the sinusoidal timestep code fed to the timestep MLP


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: [B, N, C]; shift, scale: [B, C] -> x * (1 + scale) + shift, per sample."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def sincos_1d(dim: int, positions: np.ndarray) -> np.ndarray:
    """positions: [M] -> [M, dim]: sin of the first dim/2 frequencies, then cos."""
    if dim % 2:
        raise ValueError(f"sin-cos embedding width {dim} must be even")
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    angles = np.outer(positions.reshape(-1), omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def sincos_2d(dim: int, grid_size: int) -> np.ndarray:
    """Fixed 2-D position table [grid_size**2, dim] in row-major patch order; the first half of the
    channels encodes the column (x) coordinate, the second half the row (y) coordinate."""
    if dim % 4:
        raise ValueError(f"2-D sin-cos embedding width {dim} must be divisible by 4")
    coords = np.arange(grid_size, dtype=np.float64)
    cols, rows = np.meshgrid(coords, coords)  # cols varies along the row, as patches are ordered
    return np.concatenate([sincos_1d(dim // 2, cols), sincos_1d(dim // 2, rows)], axis=1)


def timestep_code(t: torch.Tensor, dim: int = TIMESTEP_FREQUENCIES, max_period: float = 10000.0) -> torch.Tensor:
    """t: [B] (may be fractional) -> [B, dim]: cos then sin of geometrically spaced frequencies."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    code = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    if dim % 2:
        code = torch.cat([code, torch.zeros_like(code[:, :1])], dim=-1)
    return code


class TimestepEmbedder(nn.Module):
    """t: [B] -> [B, hidden] through a sinusoidal code and a 2-layer SiLU MLP."""

    def __init__(self, hidden_size: int, frequency_size: int = TIMESTEP_FREQUENCIES) -> None:
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(
            nn.Linear(frequency_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        code = timestep_code(t, self.frequency_size)
        return self.mlp(code.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """y: [B] -> [B, hidden]. Index ``num_classes`` is the null class for classifier-free guidance;
    it exists when ``dropout_prob > 0``, and labels are dropped to it only in training mode."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), hidden_size)

    def drop_labels(self, y: torch.Tensor, force_drop: torch.Tensor | None = None) -> torch.Tensor:
        drop = torch.rand(y.shape[0], device=y.device) < self.dropout_prob if force_drop is None else force_drop.bool()
        return torch.where(drop, torch.full_like(y, self.num_classes), y)

    def forward(self, y: torch.Tensor, force_drop: torch.Tensor | None = None) -> torch.Tensor:
        if (self.training and self.dropout_prob > 0) or force_drop is not None:
            y = self.drop_labels(y, force_drop)
        return self.embedding_table(y)


class DiTBlock(nn.Module):
    """adaLN-Zero transformer block. x: [B, N, C], c: [B, C] -> [B, N, C]."""

    def __init__(self, hidden_size: int, attn: nn.Module, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = attn
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio), act_layer=lambda: nn.GELU(approximate="tanh"))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaLN_modulation(c).chunk(6, dim=1)
        # The attention (and a MoH router inside it) sees the modulated token.
        x = x + gate_a.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_a, scale_a))
        return x + gate_m.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_m, scale_m))


class FinalLayer(nn.Module):
    """x: [B, N, C], c: [B, C] -> per-patch outputs [B, N, patch*patch*out_channels]."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DiT(nn.Module):
    """Class-conditional diffusion transformer.

    Args:
        input_size: H = W of the input (latent or pixel grid).
        patch_size: side of the square patches; the model sees (input_size / patch_size)**2 tokens.
        in_channels: C of the input.
        hidden_size, depth, mlp_ratio: transformer width, number of blocks, MLP expansion.
        num_heads: heads per block, an int or a per-layer list.
        class_dropout_prob: training-time label dropout to the null class (classifier-free guidance).
        num_classes: number of real classes.
        learn_sigma: also output the variance interpolation values (2C output channels).
        attn: registered attention name, or ``{"name": ..., **kwargs}`` with scalar or per-layer values
            (e.g. MoH's ``shared_heads`` / ``routed_topk``).
        head_dim: per-head width (int or per-layer list); ``None`` = hidden_size / heads. The MoH-DiT
            L and XL pyramids use 64 and 72.
    """

    def __init__(
        self,
        input_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int | Sequence[int] = 16,
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        attn: str | Mapping[str, Any] = "mha",
        head_dim: int | Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        if input_size % patch_size:
            raise ValueError(f"input_size={input_size} is not divisible by patch_size={patch_size}")
        self.input_size = input_size
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.learn_sigma = learn_sigma
        self.num_classes = num_classes
        self.hidden_size = hidden_size
        self.depth = depth

        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size, bias=True)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        num_patches = self.x_embedder.num_patches
        # A parameter (not a buffer) so the state dict matches the original; fixed, never trained.
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, hidden_size), requires_grad=False)

        name, kwargs = parse_attn_spec(attn)
        self.attn_name = name
        heads = [int(h) for h in per_layer_values(num_heads, depth, "num_heads")]
        head_dims = per_layer_values(head_dim, depth, "head_dim")
        layer_kwargs = expand_per_layer(name, kwargs, depth)
        self.blocks = nn.ModuleList(
            DiTBlock(
                hidden_size,
                build_attention(
                    name, hidden_size, num_heads=heads[i], qkv_bias=True, layer_idx=i, depth=depth,
                    **({"head_dim": head_dims[i]} if head_dims[i] is not None else {}), **layer_kwargs[i],
                ),
                mlp_ratio,
            )
            for i in range(depth)
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)
        # Attention with a grid position bias (cosine) sees the patch grid; DiT has no prefix tokens.
        grid = input_size // patch_size
        for block in self.blocks:
            if getattr(block.attn, "cpb", None) is not None:
                block.attn.set_grid_size((grid, grid))
        self.initialize_weights()

    @torch.no_grad()
    def initialize_weights(self) -> None:
        """ViT-style init; adaLN modulation and the output projection start at zero (adaLN-Zero)."""

        def xavier(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

        self.apply(xavier)
        if self.pos_embed.device.type != "meta":
            grid = int(self.x_embedder.num_patches**0.5)
            table = torch.from_numpy(sincos_2d(self.hidden_size, grid)).float()
            self.pos_embed.copy_(table.unsqueeze(0))
        proj = self.x_embedder.proj
        nn.init.xavier_uniform_(proj.weight.view(proj.weight.shape[0], -1))
        nn.init.zeros_(proj.bias)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(block.adaLN_modulation[-1].weight)
            nn.init.zeros_(block.adaLN_modulation[-1].bias)
        final = self.final_layer
        for layer in (final.adaLN_modulation[-1], final.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, N, p*p*C_out] -> [B, C_out, H, W]."""
        p, c = self.patch_size, self.out_channels
        grid = int(x.shape[1] ** 0.5)
        x = x.reshape(x.shape[0], grid, grid, p, p, c)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(x.shape[0], c, grid * p, grid * p)

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, force_drop: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [B, C, H, W], t: [B] diffusion steps, y: [B] labels (``num_classes`` = null) -> [B, C_out, H, W]."""
        tokens = self.x_embedder(x) + self.pos_embed.to(x.dtype)
        c = self.t_embedder(t) + self.y_embedder(y, force_drop)
        for block in self.blocks:
            tokens = block(tokens, c)
        return self.unpatchify(self.final_layer(tokens, c))


# --- presets -------------------------------------------------------------------------------------

_SIZES: dict[str, dict[str, Any]] = {
    "S": {"hidden_size": 384, "depth": 12, "num_heads": 6},
    "B": {"hidden_size": 768, "depth": 12, "num_heads": 12},
    "L": {"hidden_size": 1024, "depth": 24, "num_heads": 16},
    "XL": {"hidden_size": 1152, "depth": 28, "num_heads": 16},
    # Tiny, ours: small enough to train on two CPU cores (digits 8x8, Fashion-MNIST 32x32 in pixels).
    "T": {"hidden_size": 64, "depth": 6, "num_heads": 4},
}
# The original's defaults: 256 px ImageNet through the SD VAE (32x32x4 latents), 1000 classes.
_IMAGENET_LATENT = {"input_size": 32, "in_channels": 4, "num_classes": 1000}
_MOH_DIT = "MoH-DiT-"


def _build_presets() -> dict[str, dict[str, Any]]:
    presets: dict[str, dict[str, Any]] = {}
    for size, geometry in _SIZES.items():
        base = {**_IMAGENET_LATENT, **geometry}
        for patch in (1, 2, 4, 8) if size == "T" else (2, 4, 8):
            presets[f"DiT-{size}/{patch}"] = {**base, "patch_size": patch}
    # MoH-DiT: DiT's size with the released per-layer budget (visattn.models.budgets, the one home of
    # the numbers; the L and XL budgets bring their head pyramids).
    for name in list_budgets():
        if name.startswith(_MOH_DIT):
            model = {**presets[f"DiT-{name[len(_MOH_DIT):].split('/')[0]}/2"], "attn": {"name": "moh"}}
            presets[name] = apply_budget(model, name, depth=model["depth"])
    for size in ("L", "XL"):
        # The MoH-DiT head pyramid with plain multi-head attention: separates the pyramid from MoH.
        pyramid = get_budget(f"{_MOH_DIT}{size}/2-90").geometry()
        presets[f"Pyramid-DiT-{size}/2"] = {**presets[f"DiT-{size}/2"], **pyramid, "attn": "mha"}
    return presets


DIT_PRESETS: Mapping[str, Mapping[str, Any]] = _build_presets()


def dit_preset_config(preset: str, budget: BudgetSpec = None, **overrides: Any) -> dict[str, Any]:
    """Constructor keywords of ``preset`` updated by ``overrides`` (``attn`` replaces the preset's
    attention spec; the head geometry ``num_heads`` / ``head_dim`` stays unless overridden), then
    the head ``budget`` applied (a name of ``visattn.models.budgets`` or per-layer lists; see
    ``apply_budget``)."""
    if preset not in DIT_PRESETS:
        raise ValueError(f"unknown DiT preset {preset!r}; known: {', '.join(DIT_PRESETS)}")
    config = copy.deepcopy({**DIT_PRESETS[preset], **overrides})
    return apply_budget(config, budget, depth=config["depth"]) if budget is not None else config


def create_dit(preset: str, budget: BudgetSpec = None, **overrides: Any) -> DiT:
    """Build a preset, e.g. ``create_dit("MoH-DiT-XL/2-90")``,
    ``create_dit("DiT-S/2", attn="moh", budget="MoH-DiT-S/2-75")`` or
    ``create_dit("DiT-T/2", input_size=8, in_channels=1, num_classes=10)``."""
    return DiT(**dit_preset_config(preset, budget, **overrides))
