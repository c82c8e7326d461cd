"""TransNeXt's aggregated attention: each query attends, under one softmax, to its 3x3 neighbourhood
and to a pooled map of the whole image.

Per head h and query i on an (H, W) grid, with ``q^ = l2n(q_i)``:

    s_local(i, j) = (q^ + e_h) . l2n(k_j) * tau_h * log(M) + b_h(j - i)      j in the 3x3 window of i
    s_pool(i, p)  = (q^ + e_h) . l2n(k_p) * tau_h * log(M) + cpb_h(i, p)     p in the pooled map
    [a_local, a_pool] = softmax([s_local, s_pool])
    out_i = sum_j (a_local(i, j) + q^ . T_h(j) + c_h(j)) v_j + sum_p a_pool(i, p) v_p

``e_h`` the query embedding, ``tau_h = softplus(t_h)`` the temperature, ``M`` the number of keys of
query i (its in-image window positions plus the pooled tokens), ``b_h`` a learned bias per window
offset, ``cpb_h`` the continuous position bias between a query and a pooled cell, and ``T_h``/``c_h``
the learnable query-dependent tokens and their bias.
Window positions outside the image are masked (they get no weight). The pooled map is
``LayerNorm(AvgPool(GELU(Conv1x1(x))))`` at ``1 / pool_ratio`` of the grid, keyed and valued by the
same projection as the tokens.

Built on ``CosineAttention`` (query embedding, temperature, position-bias MLP) and so on
``HeadAttention``: Mixture-of-Head routing comes from the ``shared_heads`` / ``routed_topk`` keywords,
and ``visattn.active_heads`` / ``visattn.aux_loss`` see the module.

A model passes the token grid with each call (``forward_grid(x, (H, W))``), so the module traces with
torch.fx (shape-derived tables come from leaf functions) and scripts; ``forward(x)`` alone uses the grid
set by ``set_grid_size`` or a square one.
"""

from __future__ import annotations

import math

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_function

from visattn.attention.cosine import CosineAttention

GridSize = tuple[int, int]


def neighbourhood(x: torch.Tensor, grid_size: tuple[int, int], window: int) -> torch.Tensor:
    """x: [B, h, N, d] on an (H, W) grid -> [B, h, N, window^2, d], zeros outside the image."""
    B, h, N, d = x.shape
    grid = x.transpose(2, 3).reshape(B, h * d, grid_size[0], grid_size[1])
    patches = F.unfold(grid, window, padding=window // 2)  # [B, h*d*window^2, N]
    return patches.view(B, h, d, window * window, N).permute(0, 1, 4, 3, 2)


@register_notrace_function  # a leaf for torch.fx: the grid is runtime ints
def window_geometry(
    ref: torch.Tensor, grid_size: tuple[int, int], window: int, num_pooled: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Window slots inside the image ``[N, window^2]`` (bool) and ``log(M)`` per query ``[N, 1]``, with
    ``M`` the query's keys: its in-image window positions plus the ``num_pooled`` pooled tokens."""
    ones = torch.ones(1, 1, grid_size[0], grid_size[1], device=ref.device)
    valid = F.unfold(ones, window, padding=window // 2)[0].t() > 0
    return valid, (valid.sum(dim=-1, keepdim=True) + num_pooled).float().log()


torch.fx.wrap("window_geometry")  # a leaf for plain torch.fx.symbolic_trace too


@register_notrace_function  # a leaf for torch.fx: the grid is runtime ints
def pooled_size(grid_size: tuple[int, int], pool_ratio: int) -> tuple[int, int]:
    """The pooled map of an (H, W) grid: (H // pool_ratio, W // pool_ratio), at least 1 x 1."""
    return max(1, grid_size[0] // pool_ratio), max(1, grid_size[1] // pool_ratio)


torch.fx.wrap("pooled_size")  # a leaf for plain torch.fx.symbolic_trace too


class AggregatedAttention(CosineAttention):
    """Aggregated attention on a token grid. x: [B, N, C] with N = H * W -> [B, N, C].

    Args (besides ``CosineAttention``'s and ``HeadAttention``'s):
        pool_ratio: the pooled map is (H // pool_ratio, W // pool_ratio) (at least 1 x 1).
        window_size: side of the local neighbourhood (odd; 3 in TransNeXt).
        pretrain_size: (H, W) token grid of pre-training; scales the position-bias offsets to pooled
            cells as the release does (None = the grid met at run time).

    Call ``forward_grid(x, (H, W))``; ``forward(x)`` uses the grid of ``set_grid_size`` or a square.
    """

    swappable = False

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        pool_ratio: int = 2,
        window_size: int = 3,
        device=None,
        dtype=None,
        **kwargs,
    ) -> None:
        if kwargs.get("num_kv_heads") not in (None, num_heads):
            raise ValueError(
                f"aggregated attention needs one key/value head per query head; got "
                f"num_kv_heads={kwargs['num_kv_heads']}, leave it unset"
            )
        if pool_ratio < 1:
            raise ValueError(f"pool_ratio={pool_ratio} must be >= 1")
        if window_size < 1 or window_size % 2 == 0:
            raise ValueError(f"window_size={window_size} must be a positive odd number (3 in TransNeXt)")
        super().__init__(dim, num_heads, device=device, dtype=dtype, **kwargs)
        dd = {"device": device, "dtype": dtype}
        self.pool_ratio = pool_ratio
        self.window_size = window_size
        local = window_size * window_size
        self.local_bias = nn.Parameter(torch.empty(num_heads, 1, local, **dd))
        self.learnable_tokens = nn.Parameter(torch.empty(num_heads, self.head_dim, local, **dd))
        self.learnable_bias = nn.Parameter(torch.zeros(num_heads, 1, local, **dd))
        nn.init.trunc_normal_(self.local_bias, std=0.0004)
        nn.init.trunc_normal_(self.learnable_tokens, std=0.02)
        self.sr = nn.Conv2d(dim, dim, 1, **dd)
        self.pool_act = nn.GELU()
        self.pool_norm = nn.LayerNorm(dim, **dd)

    @torch.jit.unused
    def set_grid_size(self, grid_size: GridSize | None) -> None:
        """Token grid (H, W) of the following ``forward(x)`` calls; None = infer a square grid from N."""
        if grid_size is not None and (len(grid_size) != 2 or any(int(s) != s or s < 1 for s in grid_size)):
            raise ValueError(f"grid_size={grid_size!r} must be two positive ints (height, width)")
        self.grid_size = None if grid_size is None else (int(grid_size[0]), int(grid_size[1]))

    def resolve_grid(self, num_tokens: int) -> tuple[int, int]:
        """The (H, W) grid of ``num_tokens`` tokens: the one set, else a square."""
        grid_size = self.grid_size
        if grid_size is not None:
            if grid_size[0] * grid_size[1] != num_tokens:
                raise ValueError(
                    "grid_size=" + str(grid_size) + " does not fit " + str(num_tokens)
                    + " tokens; call set_grid_size with this input's token grid"
                )
            return grid_size
        side = int(math.sqrt(num_tokens) + 0.5)
        if side * side != num_tokens:
            raise ValueError(str(num_tokens) + " tokens are not a square grid; call set_grid_size((H, W)) first")
        return side, side

    def pooled_tokens(self, x: torch.Tensor, grid_size: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
        """x: [B, N, C] -> pooled map [B, P, C] and its (H_p, W_p)."""
        B, _, C = x.shape
        size = pooled_size(grid_size, self.pool_ratio)
        grid = self.pool_act(self.sr(x.transpose(1, 2).reshape(B, C, grid_size[0], grid_size[1])))
        pooled = F.adaptive_avg_pool2d(grid, size).flatten(2).transpose(1, 2)
        return self.pool_norm(pooled), size

    def pooled_kv(self, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the pooled map with the tokens' projection: [B, P, C] -> 2 x [B, h, P, d]."""
        B, P, _ = pooled.shape
        bias = self.qkv.bias
        if bias is not None:
            bias = bias[self.attn_dim :]
        k, v = F.linear(pooled, self.qkv.weight[self.attn_dim :], bias).chunk(2, dim=-1)
        k = k.view(B, P, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, P, self.num_heads, self.head_dim).transpose(1, 2)
        return self.k_norm(k), v

    def attention_probs(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        pooled_k: torch.Tensor,
        grid_size: tuple[int, int],
        pool_size: tuple[int, int],
    ) -> torch.Tensor:
        """Joint softmax over window and pooled keys: [B, h, N, window^2 + P] (window slots first;
        slots outside the image are exactly 0)."""
        valid, log_keys = window_geometry(q, grid_size, self.window_size, pooled_k.shape[-2])
        scale = F.softplus(self.temperature) * log_keys  # [h, N, 1]: border queries see fewer keys
        q = (F.normalize(q, dim=-1) + self.query_embedding) * scale.to(q.dtype)
        k_local = neighbourhood(F.normalize(k, dim=-1), grid_size, self.window_size)
        s_local = torch.einsum("bhnd,bhnkd->bhnk", q, k_local) + self.local_bias.to(q.dtype)
        s_local = s_local.masked_fill(~valid, float("-inf"))
        s_pool = q @ F.normalize(pooled_k, dim=-1).transpose(-2, -1)
        if self.cpb is not None:
            s_pool = s_pool + self.cpb(grid_size, pool_size).to(q.dtype)
        return torch.cat([s_local, s_pool], dim=-1).softmax(dim=-1)

    def aggregate(
        self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid_size: tuple[int, int]
    ) -> torch.Tensor:
        """Per-head outputs before head gating. x: [B, N, C], q/k/v: [B, h, N, d] -> [B, h, N, d]."""
        pooled, pool_size = self.pooled_tokens(x, grid_size)
        pooled_k, pooled_v = self.pooled_kv(pooled)
        probs = self.attn_drop(self.attention_probs(q, k, pooled_k, grid_size, pool_size))
        local = self.window_size * self.window_size
        query_tokens = F.normalize(q, dim=-1) @ self.learnable_tokens + self.learnable_bias
        w_local = probs[..., :local] + query_tokens.to(probs.dtype)
        out_local = torch.einsum("bhnk,bhnkd->bhnd", w_local, neighbourhood(v, grid_size, self.window_size))
        return out_local + probs[..., local:] @ pooled_v

    def forward_grid(self, x: torch.Tensor, grid_size: tuple[int, int]) -> torch.Tensor:
        """x: [B, H*W, C] on the (H, W) grid -> [B, H*W, dim_out]."""
        q, k, v = self.project_qkv(x)
        gates, _ = self.route(x, q)
        return self.merge_heads(x, self.aggregate(x, q, k, v, grid_size), gates)

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """x: [B, N, C] on the grid set by ``set_grid_size`` (else square) -> [B, N, dim_out]."""
        if attn_mask is not None or is_causal:
            raise ValueError(
                "aggregated attention attends to a fixed spatial neighbourhood; "
                "attn_mask and is_causal are not supported, pass neither"
            )
        return self.forward_grid(x, self.resolve_grid(x.shape[1]))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, pool_ratio={self.pool_ratio}, window={self.window_size}"
