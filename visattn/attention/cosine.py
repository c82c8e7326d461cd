"""TransNeXt-style cosine attention (the attention of MoH-ViT), with a continuous position bias.

score_h(i, j) = (l2n(q_i) + e_h) . l2n(k_j) * softplus(t_h) * log(M) + bias_h(i, j)

with ``e_h`` a learned per-head query embedding, ``softplus(t_h)`` a learned per-head temperature
(initialised to 1/0.24), ``M`` the number of keys at run time, and ``bias_h`` the output of a small
MLP (2 -> hidden -> heads) over log-spaced 2-D offsets between grid tokens. The grid is the last
``H * W`` tokens; leading tokens (a class token) get no bias. Without a grid given, the layer infers
a square one from the token count (see ``CosineAttention``), so its bias trains however it is built
(a bare ``attn_layer=CosineAttention`` in timm's ViT included). MoH routing comes from
``HeadAttention`` (``build_attention("cosine", ..., shared_heads=2, routed_topk=2)``).

Public helpers reused by the TransNeXt aggregated attention: ``log_spaced_relative_coords`` and
``ContinuousPositionBias`` (query grid -> key grid, pooled key grids included).
"""

from __future__ import annotations

import math

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_function

from .base import HeadAttention
from .registry import register_attention
from .scores import add_mask, additive_mask

GridSize = tuple[int, int]

# Leaves for torch.fx, patched in this module's globals (see visattn.attention.scores).
torch.fx.wrap("additive_mask")
torch.fx.wrap("add_mask")


def _grid_size(size, what: str = "grid_size") -> GridSize:
    if len(size) != 2 or any(int(s) != s or s < 1 for s in size):
        raise ValueError(f"{what}={size!r} must be two positive ints (height, width)")
    return int(size[0]), int(size[1])


def _axis_offsets(
    query_len: int, key_len: int, pretrain_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-spaced offsets along one axis: unique values [U] and index [query_len, key_len] into them.

    Keys sit at the mean position of the query cells they pool (adaptive average pooling). When the
    pooling is uniform (``query_len % key_len == 0``, always in TransNeXt) the offsets are a run of
    integers shifted by half a bin and no ``torch.unique`` is needed (static shapes for
    ``torch.compile``; works on the meta device).
    """
    if query_len % key_len == 0:
        ratio = query_len // key_len
        lowest = -(key_len - 1) * ratio
        offsets = torch.arange(lowest, query_len, dtype=torch.float32, device=device) - (ratio - 1) / 2
        q = torch.arange(query_len, device=device)
        index = q[:, None] - torch.arange(key_len, device=device)[None, :] * ratio - lowest
    else:
        cpu = torch.device("cpu")
        axis_q = torch.arange(query_len, dtype=torch.float32, device=cpu)
        axis_k = F.adaptive_avg_pool1d(axis_q[None], key_len)[0]
        offsets, index = torch.unique((axis_q[:, None] - axis_k[None, :]).flatten(), sorted=True, return_inverse=True)
        offsets, index = offsets.to(device), index.view(query_len, key_len).to(device)
    offsets = offsets / max(pretrain_len - 1, 1) * 8.0
    return torch.sign(offsets) * torch.log2(offsets.abs() + 1.0) / 3.0, index  # / log2(8)


@register_notrace_function  # a leaf for torch.fx: the grid sizes are runtime ints
def relative_coords_index(
    ref: torch.Tensor,
    query_size: tuple[int, int],
    key_size: tuple[int, int],
    pretrain_size: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Offset table ``[T, 2]`` (float32, on ``ref``'s device) and index ``[Hq*Wq, Hk*Wk]`` (long) into it.

    See ``log_spaced_relative_coords``; the index here keeps its (query, key) shape.
    """
    qh, qw = query_size
    kh, kw = key_size
    if qh < 1 or qw < 1 or kh < 1 or kw < 1 or kh > qh or kw > qw:
        raise ValueError(
            "query_size=" + str(query_size) + " and key_size=" + str(key_size) + " must be positive, "
            "with the key grid no larger than the query grid (keys are pooled queries)"
        )
    ph, pw = (qh, qw) if pretrain_size is None else pretrain_size
    rows, row_index = _axis_offsets(qh, kh, ph, ref.device)
    cols, col_index = _axis_offsets(qw, kw, pw, ref.device)
    table = torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1).view(-1, 2)
    # every (row offset, column offset) pair occurs, so the table is their product in (row, column) order
    index = row_index[:, None, :, None] * cols.shape[0] + col_index[None, :, None, :]
    return table, index.reshape(qh * qw, kh * kw)


torch.fx.wrap("relative_coords_index")  # a leaf for plain torch.fx.symbolic_trace too


@register_notrace_function  # a leaf for torch.fx: the token count is a runtime int
def square_grid_side(num_tokens: int, num_prefix_tokens: int, inferred: bool = False) -> int:
    """Side S of the square S x S grid that the last S * S of ``num_tokens`` tokens form.

    ``num_prefix_tokens >= 0``: that many tokens precede the grid, and ``num_tokens - num_prefix_tokens``
    must be a perfect square >= 1. ``-1`` (unknown): S = floor(sqrt(num_tokens)), the largest square
    that fits, the rest being prefix tokens; right whenever there are at most 2 * S prefix tokens
    (a class token and register tokens in front of any grid of 2 x 2 or more). ``inferred``: the
    prefix count was inferred at the layer's first call (for the error message).
    """
    if num_tokens < 1:
        raise ValueError(
            "cosine attention got " + str(num_tokens) + " tokens; a token grid needs at least one"
        )
    if num_prefix_tokens < 0:
        side = int(math.sqrt(num_tokens))
        while side * side > num_tokens:  # float rounding of sqrt
            side -= 1
        while (side + 1) * (side + 1) <= num_tokens:
            side += 1
        return side
    grid = num_tokens - num_prefix_tokens
    side = int(math.sqrt(max(grid, 0)) + 0.5)
    if grid < 1 or side * side != grid:
        how = " (inferred at the layer's first call)" if inferred else ""
        raise ValueError(
            "cosine attention infers a square token grid: " + str(num_tokens) + " tokens minus "
            + str(num_prefix_tokens) + " prefix token(s)" + how + " leave " + str(grid)
            + ", not a square number of grid tokens; give this input's grid with set_grid_size((H, W)) "
            "(grid_size=(H, W) when building), or num_prefix_tokens= the tokens in front of the grid"
        )
    return side


torch.fx.wrap("square_grid_side")  # a leaf for plain torch.fx.symbolic_trace too


def log_spaced_relative_coords(
    query_size: GridSize,
    key_size: GridSize | None = None,
    pretrain_size: GridSize | None = None,
    device=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique 2-D offsets between a query grid and a key grid, log-spaced as TransNeXt / MoH-ViT do.

    The key grid covers the same area as the query grid; a smaller key grid (pooled keys) sits at the
    average positions of the query cells it pools. Offsets in query-grid cells are scaled by
    ``8 / (P - 1)`` per axis, ``P`` the query grid of pre-training (``pretrain_size``; default the query
    grid itself, as the release does when ``pretrain_size`` is not given), so the longest offset seen in
    pre-training is 8, then mapped by ``sign(d) * log2(1 + |d|) / log2(8)`` (into [-1, 1] at that size).
    An axis of length 1 in ``pretrain_size`` (where the release divides by zero) counts as scale 8.

    Returns ``table [T, 2]`` (float32) and ``index [Nq * Nk]`` (long) with
    ``table[index].view(Nq, Nk, 2)`` the offset of every (query, key) pair.
    """
    query_size = _grid_size(query_size, "query_size")
    key_size = query_size if key_size is None else _grid_size(key_size, "key_size")
    pretrain_size = None if pretrain_size is None else _grid_size(pretrain_size, "pretrain_size")
    ref = torch.empty(0, device=device)
    table, index = relative_coords_index(ref, query_size, key_size, pretrain_size)
    return table, index.flatten()


class ContinuousPositionBias(nn.Module):
    """Per-head bias from an MLP over log-spaced offsets: (query_size, key_size) -> [heads, Nq, Nk].

    ``pretrain_size``: the (H, W) query grid of pre-training that offsets are scaled by (see
    ``log_spaced_relative_coords``); None = the query grid met at run time (the release's default).
    Give the pre-training grid to run released weights at another input size. The offset table is
    rebuilt per call (per-axis work, small next to the MLP), so one module serves any resolution and
    scripts / traces without a cache.
    """

    def __init__(
        self, num_heads: int, hidden: int = 512, pretrain_size: GridSize | None = None, device=None, dtype=None
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.num_heads = num_heads
        self.pretrain_size: GridSize | None = (
            None if pretrain_size is None else _grid_size(pretrain_size, "pretrain_size")
        )
        self.fc1 = nn.Linear(2, hidden, **dd)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, num_heads, **dd)

    def coords(self, query_size: GridSize, key_size: GridSize | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``log_spaced_relative_coords`` with this module's pre-training grid, on its device."""
        return log_spaced_relative_coords(query_size, key_size, self.pretrain_size, device=self.fc1.weight.device)

    def forward(self, query_size: tuple[int, int], key_size: tuple[int, int] | None = None) -> torch.Tensor:
        """-> bias [heads, Hq*Wq, Hk*Wk]."""
        if key_size is None:
            key_size = query_size
        table, index = relative_coords_index(self.fc1.weight, query_size, key_size, self.pretrain_size)
        per_offset = self.fc2(self.act(self.fc1(table.to(self.fc1.weight.dtype))))  # [T, heads]
        return per_offset.t()[:, index]

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, pretrain_size={self.pretrain_size}"


AUTO = "auto"  # grid_size: infer a square grid from each input's token count
CALLER = "caller"  # grid_size: the caller passes the bias as the attention mask (TransNeXt's blocks)


@register_attention("cosine")
class CosineAttention(HeadAttention):
    """Cosine attention with query embedding, softplus temperature, log(M) scale and a position bias.

    x: [B, N, C] -> [B, N, dim_out]. The position bias covers the last ``H * W`` tokens (the grid);
    tokens in front of it (a ViT's class and register tokens) get zero bias in their rows and columns.
    The bias MLP (``cpb``) is built at construction whenever ``position_bias=True``, so parameters,
    ``state_dict`` keys, ``torch.compile`` and DDP do not depend on the input; only the offset table
    is derived per call (never stored).

    Where the grid comes from (``grid_size``):
        None (the default): ``"auto"``, or ``"caller"`` when ``pretrain_size`` is given.
        ``"auto"``: a square S x S grid behind P prefix tokens, inferred from each call's token count
            N = P + S * S. P is ``num_prefix_tokens`` when given (``swap_attention`` gives a timm ViT's);
            otherwise the layer's first call infers it, as N minus the largest square <= N (17 tokens:
            a class token and 4 x 4; 21: five prefix tokens and 4 x 4; 16: none and 4 x 4), and keeps
            it. A later call whose N - P is not a square (a non-square image under timm's
            ``dynamic_img_size``) is refused with a ValueError; square grids of any size are followed.
            The inference is right whenever P <= 2 * S (class and register tokens in front of a grid
            of 2 x 2 or more); give ``num_prefix_tokens`` or ``grid_size`` otherwise. A bare
            ``attn_layer=CosineAttention`` in timm's ``VisionTransformer`` gets this, so its bias
            trains. (A torch.fx graph traced before the first call infers P on every call.)
        ``(H, W)``: that grid on every call (another token count is refused); ``set_grid_size``
            changes it per input size.
        ``"caller"``: no bias of the layer's own: the caller passes it as the attention mask,
            ``layer(x, attn_mask=layer.cpb(grid, grid))``, as TransNeXt's blocks do; a call without a
            mask is refused, so the MLP cannot go unused.

    So with ``position_bias=True`` (the default) the bias MLP is used however the layer is built;
    ``position_bias=False`` builds none. ``set_grid_size(None)`` turns the bias off for the calls
    that follow (the MLP then gets no gradient).

    Args (besides ``HeadAttention``'s):
        grid_size: None, ``"auto"``, ``(H, W)`` or ``"caller"`` (above).
        num_prefix_tokens: tokens in front of the grid (a ViT's class and register tokens; given by
            ``swap_attention`` from the model); an input with another count is refused, so a stale
            grid cannot bias the wrong tokens. None = inferred at the first call (``"auto"``), or
            whatever precedes the last H*W tokens (a fixed grid).
        position_bias: build the continuous position bias MLP (False: never any bias).
        cpb_hidden: hidden width of that MLP (512 in TransNeXt / MoH-ViT).
        pretrain_size: (H, W) token grid of pre-training, which scales the bias's offsets (see
            ``ContinuousPositionBias``); None = the grid met at run time.
        temperature_init: initial softplus(temperature) per head.
    """

    list_kwargs = ("grid_size", "pretrain_size")

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        grid_size: GridSize | str | None = None,
        num_prefix_tokens: int | None = None,
        position_bias: bool = True,
        cpb_hidden: int = 512,
        pretrain_size: GridSize | None = None,
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
        self.cpb = ContinuousPositionBias(num_heads, cpb_hidden, pretrain_size, **dd) if position_bias else None
        if num_prefix_tokens is not None and num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens={num_prefix_tokens} must be >= 0 (None: any count)")
        self.num_prefix_tokens = num_prefix_tokens
        self.grid_size: GridSize | None = None
        self.infer_grid = False  # grid_size "auto"
        self.bias_from_caller = False  # grid_size "caller"
        self.inferred_prefix = -1  # prefix tokens inferred at the first call ("auto", no num_prefix_tokens)
        if grid_size is None and position_bias:
            grid_size = CALLER if pretrain_size is not None else AUTO
        if isinstance(grid_size, str):
            self.set_grid_mode(grid_size)
        elif grid_size is not None:
            self.set_grid_size(grid_size)

    def set_grid_mode(self, mode: str) -> None:
        """``"auto"``: infer the grid per call (forgetting a prefix count inferred before);
        ``"caller"``: the bias comes as the attention mask. See the class docstring."""
        if mode not in (AUTO, CALLER):
            raise ValueError(f"grid_size={mode!r} must be (H, W), {AUTO!r}, {CALLER!r} or None")
        if self.cpb is None:
            raise ValueError(f"grid_size={mode!r} needs position_bias=True (this module has no bias MLP)")
        self.grid_size = None
        self.infer_grid, self.bias_from_caller, self.inferred_prefix = mode == AUTO, mode == CALLER, -1

    def set_grid_size(self, grid_size: GridSize | str | None) -> None:
        """Token grid (H, W) of the following forwards (the last H*W tokens); None = no bias from now
        on; ``"auto"`` / ``"caller"``: see the class docstring."""
        if isinstance(grid_size, str):
            self.set_grid_mode(grid_size)
            return
        if grid_size is not None:
            if self.cpb is None:
                raise ValueError(f"grid_size={grid_size!r} needs position_bias=True (this module has no bias MLP)")
            grid_size = _grid_size(grid_size)
        self.grid_size = grid_size
        self.infer_grid = self.bias_from_caller = False

    def relative_position_bias(self, num_queries: int, num_keys: int) -> torch.Tensor | None:
        """[H, N, M] bias over the whole sequence, or None without a grid (``grid_size`` None or
        ``"caller"``). With ``"auto"``, the first call fixes the inferred prefix count.

        The grid is the last ``H * W`` tokens; leading prefix tokens (a ViT's class and register
        tokens) get zero bias in their rows and columns. The released MoH-ViT / TransNeXt have no
        prefix tokens, so this choice only matters in a ViT, where it keeps the class token's
        attention unbiased.
        """
        cpb = self.cpb
        if cpb is None:
            return None
        grid_size = self.grid_size
        if grid_size is None:
            if self.infer_grid:
                return self.inferred_position_bias(num_queries, num_keys)
            return None
        h, w = grid_size
        prefix = num_queries - h * w
        # Checked on ints only: under torch.fx the token counts are symbolic and the check is skipped.
        if isinstance(prefix, int):
            wrong_prefix, after = False, ""
            expected = self.num_prefix_tokens
            if expected is not None:  # a block, not an and-chain: TorchScript types a None attribute as NoneType
                wrong_prefix, after = prefix != expected, f" after {expected} prefix tokens"
            if num_queries != num_keys or prefix < 0 or wrong_prefix:
                raise ValueError(
                    f"grid_size=({h}, {w}) ({h * w} grid tokens{after}) does not fit {num_queries} queries and "
                    f"{num_keys} keys; call set_grid_size with this input's token grid (or None), in a visattn "
                    "ViT after set_input_size: visattn.models.vit.set_patch_grid(model)"
                )
        bias = cpb(grid_size)
        if isinstance(prefix, int) and prefix == 0:
            return bias
        return F.pad(bias, (prefix, 0, prefix, 0))

    def inferred_position_bias(self, num_queries: int, num_keys: int) -> torch.Tensor | None:
        """``relative_position_bias`` of ``grid_size="auto"``: [H, N, N] over a square grid behind the
        prefix tokens (see the class docstring), or None for an empty sequence."""
        cpb = self.cpb
        if cpb is None:
            return None
        if isinstance(num_queries, int):  # symbolic under torch.fx: checked by square_grid_side at run time
            if num_queries != num_keys:
                raise ValueError(
                    f"grid_size='auto' infers the token grid of self-attention, but got {num_queries} "
                    f"queries and {num_keys} keys; give grid_size=(H, W), or position_bias=False"
                )
            if num_queries == 0:
                return None
        expected = self.num_prefix_tokens
        prefix = self.inferred_prefix
        inferred = prefix >= 0
        if expected is not None:  # a block, not an and-chain: TorchScript types a None attribute as NoneType
            prefix, inferred = expected, False
        side = square_grid_side(num_queries, prefix, inferred)
        # the first call keeps the inferred prefix count (not while fx traces: the counts are symbolic)
        if prefix < 0 and isinstance(side, int) and isinstance(num_queries, int):
            self.inferred_prefix = num_queries - side * side
        pad = num_queries - side * side
        bias = cpb((side, side))
        if isinstance(pad, int) and pad == 0:
            return bias
        return F.pad(bias, (pad, 0, pad, 0))

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
        if self.bias_from_caller and attn_mask is None:
            raise ValueError(
                "this cosine attention has grid_size='caller' (the default when pretrain_size is given): "
                "its position bias comes as attn_mask=layer.cpb(grid, grid), and none was given; pass it, "
                "or build the layer with grid_size='auto' or (H, W) to add its own (position_bias=False: none)"
            )
        bias = self.relative_position_bias(n, m)
        if bias is not None:
            attn_mask = add_mask(bias.to(q.dtype), additive_mask(attn_mask, is_causal, n, m, q.dtype, q.device))
            is_causal = False
        return self.sdpa(q, k, v, attn_mask, is_causal, scale=1.0)

    def extra_repr(self) -> str:
        grid = self.grid_size
        if grid is None and (self.infer_grid or self.bias_from_caller):
            grid = AUTO if self.infer_grid else CALLER
        return f"{super().extra_repr()}, grid_size={grid!r}, num_prefix_tokens={self.num_prefix_tokens}"
