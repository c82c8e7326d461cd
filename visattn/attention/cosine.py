"""TransNeXt-style cosine attention (the attention of MoH-ViT), with a continuous position bias.

score_h(i, j) = (l2n(q_i) + e_h) . l2n(k_j) * softplus(t_h) * log(M) + bias_h(i, j)

with ``e_h`` a learned per-head query embedding, ``softplus(t_h)`` a learned per-head temperature
(initialised to 1/0.24), ``M`` the number of keys at run time, and ``bias_h`` the output of a small
MLP (2 -> hidden -> heads) over log-spaced 2-D offsets between grid tokens. The grid is the last
``H * W`` tokens; leading tokens (a class token) get no bias. MoH routing comes from
``HeadAttention`` (``build_attention("cosine", ..., shared_heads=2, routed_topk=2)``).

Public helpers reused by the TransNeXt aggregated attention: ``log_spaced_relative_coords`` and
``ContinuousPositionBias`` (query grid -> key grid, pooled key grids included).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import HeadAttention
from .registry import register_attention
from .scores import additive_mask

GridSize = tuple[int, int]


def _grid_size(size, what: str = "grid_size") -> GridSize:
    if len(size) != 2 or any(int(s) != s or s < 1 for s in size):
        raise ValueError(f"{what}={size!r} must be two positive ints (height, width)")
    return int(size[0]), int(size[1])


def log_spaced_relative_coords(
    query_size: GridSize, key_size: GridSize | None = None, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique 2-D offsets between a query grid and a key grid, log-spaced.

    The key grid covers the same area as the query grid; a smaller key grid (pooled keys) sits at the
    average positions of the query cells it pools. Offsets are in query-grid cells, mapped by
    ``sign(d) * log2(1 + |d|) / 3`` so the same distance gives the same coordinate at any resolution.

    Returns ``table [T, 2]`` (float32) and ``index [Nq * Nk]`` (long) with
    ``table[index].view(Nq, Nk, 2)`` the offset of every (query, key) pair.
    """
    query_size = _grid_size(query_size, "query_size")
    key_size = query_size if key_size is None else _grid_size(key_size, "key_size")
    axes_q = [torch.arange(s, dtype=torch.float32, device=device) for s in query_size]
    axes_k = [
        ax if s == len(ax) else F.adaptive_avg_pool1d(ax[None], s)[0] for ax, s in zip(axes_q, key_size, strict=True)
    ]
    coords_q = torch.stack(torch.meshgrid(*axes_q, indexing="ij"), dim=-1).view(-1, 2)
    coords_k = torch.stack(torch.meshgrid(*axes_k, indexing="ij"), dim=-1).view(-1, 2)
    offsets = (coords_q[:, None] - coords_k[None]).view(-1, 2)
    table, index = torch.unique(offsets, dim=0, return_inverse=True)
    table = torch.sign(table) * torch.log2(1.0 + table.abs()) / 3.0
    return table, index


class ContinuousPositionBias(nn.Module):
    """Per-head bias from an MLP over log-spaced offsets: (query_size, key_size) -> [heads, Nq, Nk].

    Offset tables are computed once per (query size, key size, device) and cached on the instance,
    so one module serves any input resolution.
    """

    def __init__(self, num_heads: int, hidden: int = 512, device=None, dtype=None) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.num_heads = num_heads
        self.fc1 = nn.Linear(2, hidden, **dd)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, num_heads, **dd)
        self._coords: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def coords(self, query_size: GridSize, key_size: GridSize | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached ``log_spaced_relative_coords`` on this module's device."""
        device = self.fc1.weight.device
        key = (tuple(query_size), tuple(key_size or query_size), device)
        if key not in self._coords:
            self._coords[key] = log_spaced_relative_coords(query_size, key_size, device=device)
        return self._coords[key]

    def forward(self, query_size: GridSize, key_size: GridSize | None = None) -> torch.Tensor:
        """-> bias [heads, Hq*Wq, Hk*Wk]."""
        table, index = self.coords(query_size, key_size)
        per_offset = self.fc2(self.act(self.fc1(table.to(self.fc1.weight.dtype))))  # [T, heads]
        nq = query_size[0] * query_size[1]
        return per_offset.t()[:, index].view(self.num_heads, nq, -1)


@register_attention("cosine")
class CosineAttention(HeadAttention):
    """Cosine attention with query embedding, softplus temperature, log(M) scale and a position bias.

    Args (besides ``HeadAttention``'s):
        grid_size: (H, W) of the token grid (the last H*W tokens); None = no position bias.
            Change it per input size with ``set_grid_size``.
        position_bias: build the continuous position bias MLP (False: never any bias).
        cpb_hidden: hidden width of that MLP (512 in TransNeXt / MoH-ViT).
        temperature_init: initial softplus(temperature) per head.
    """

    list_kwargs = ("grid_size",)

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        grid_size: GridSize | None = None,
        position_bias: bool = True,
        cpb_hidden: int = 512,
        temperature_init: float = 1 / 0.24,
        device=None,
        dtype=None,
        **kwargs,
    ) -> None:
        super().__init__(dim, num_heads, device=device, dtype=dtype, **kwargs)
        if temperature_init <= 0:
            raise ValueError(f"temperature_init={temperature_init} must be > 0 (it is softplus of a parameter)")
        dd = {"device": device, "dtype": dtype}
        inverse_softplus = math.log(math.expm1(temperature_init))
        self.temperature = nn.Parameter(torch.full((num_heads, 1, 1), inverse_softplus, **dd))
        self.query_embedding = nn.Parameter(torch.empty(num_heads, 1, self.head_dim, **dd))
        nn.init.trunc_normal_(self.query_embedding, std=0.02)
        self.cpb = ContinuousPositionBias(num_heads, cpb_hidden, **dd) if position_bias else None
        self.grid_size: GridSize | None = None
        if grid_size is not None:
            self.set_grid_size(grid_size)

    def set_grid_size(self, grid_size: GridSize | None) -> None:
        """Token grid (H, W) of the following forwards (the last H*W tokens); None = no bias."""
        if grid_size is not None:
            if self.cpb is None:
                raise ValueError(f"grid_size={grid_size!r} needs position_bias=True (this module has no bias MLP)")
            grid_size = _grid_size(grid_size)
        self.grid_size = grid_size

    def relative_position_bias(self, num_queries: int, num_keys: int) -> torch.Tensor | None:
        """[H, N, M] bias over the whole sequence, or None without a grid.

        The grid is the last ``H * W`` tokens; leading prefix tokens (a ViT's class and register
        tokens) get zero bias in their rows and columns. The released MoH-ViT / TransNeXt have no
        prefix tokens, so this choice only matters in a ViT, where it keeps the class token's
        attention unbiased.
        """
        grid_size = self.grid_size
        if grid_size is None or self.cpb is None:
            return None
        h, w = grid_size
        prefix = num_queries - h * w
        # Checked on ints only: under torch.fx the token counts are symbolic and the check is skipped.
        if isinstance(prefix, int) and (num_queries != num_keys or prefix < 0):
            raise ValueError(
                f"grid_size=({h}, {w}) ({h * w} grid tokens) does not fit {num_queries} queries and "
                f"{num_keys} keys; call set_grid_size with this input's token grid (or None)"
            )
        bias = self.cpb(grid_size)
        if isinstance(prefix, int) and prefix == 0:
            return bias
        return F.pad(bias, (prefix, 0, prefix, 0))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """q: [B, H, N, d], k/v: [B, H_kv, M, d] -> [B, H, N, d]."""
        n, m = q.shape[-2], k.shape[-2]
        scale = F.softplus(self.temperature) * math.log(m)
        q = (F.normalize(q, dim=-1) + self.query_embedding) * scale.to(q.dtype)
        k = F.normalize(k, dim=-1)
        bias = self.relative_position_bias(n, m)
        if bias is not None:
            mask = additive_mask(attn_mask, is_causal, n, m, q.dtype, q.device)
            attn_mask = bias.to(q.dtype) if mask is None else mask + bias.to(q.dtype)
            is_causal = False
        return self.sdpa(q, k, v, attn_mask, is_causal, scale=1.0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, grid_size={self.grid_size}"
