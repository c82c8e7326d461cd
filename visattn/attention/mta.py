"""Multi-Token Attention (MTA): convolutions over the attention map and across heads.

Per head, the score map ``A^ = q k^T / sqrt(d)`` ([N queries, M keys]) goes through
    key-query conv (kernel c_q x c_k, per head; ``kq_conv="pre"`` before softmax by default),
    head-mixing conv (groups of c_h heads; ``head_conv="post"`` after softmax by default),
then the heads' outputs get a per-head RMS norm scaled by ``1 - lambda_init(layer_idx)``
(``lambda_init(l) = 0.8 - 0.6 exp(-0.3 l)``, as Differential Transformer) when ``group_norm=True``.
When both mixings sit on the same side of the softmax they are one 3-D convolution (kernel
c_h x c_q x c_k over groups of heads), as the paper does.

Masking (the seed's double masking): masked scores are set to 0 before a pre-softmax convolution
(so they add nothing) and to -inf after it; after a post-softmax convolution masked weights are set
to 0 again. With ``causal=True`` the query axis is padded with past queries only, so output i
reads no query, key or value after i. Without it (vision) both axes are padded symmetrically.

Kernels start as identities, so a fresh layer with ``group_norm=False`` equals ``mha`` with the same
qkv/proj weights.

Two exact implementations: ``attention_weights`` (the reference: builds the [B, H, N, M] map) and
``factorized_heads`` (unmasked, non-causal: folds the convolutions into stacked shifted q/k/v so
SDPA never materialises the map); a test holds them equal.
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
from .scores import add_mask, additive_mask, dot_scores, expand_kv_groups, zero_masked

STAGES = ("pre", "post", None)
IMPLS = ("reference", "factorized")

# Leaves for torch.fx, patched in this module's globals (see visattn.attention.scores).
torch.fx.wrap("add_mask")
torch.fx.wrap("zero_masked")


@torch.fx.wrap
@register_notrace_function  # a leaf for torch.fx: checks and branches on attn_mask and is_causal
def layer_mask(
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    causal: bool,
    n: int,
    m: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """``additive_mask`` [.., N, M] of a layer built with ``causal`` (past-only kernels, the future
    always masked) or not; ``is_causal=True`` needs ``causal``."""
    if is_causal and not causal:
        raise ValueError("is_causal=True needs an mta layer built with causal=True (its kernels are past-only)")
    return additive_mask(attn_mask, causal, n, m, dtype, device)


def _shifts(x: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """x: [..., N, d] -> [..., len(offsets), N, d] with out[..., o, i] = x[..., i + offsets[o]] (0 outside)."""
    n = x.shape[-2]
    lo, hi = max(0, -min(offsets)), max(0, max(offsets))
    padded = F.pad(x, (0, 0, lo, hi))
    return torch.stack([padded[..., lo + off : lo + off + n, :] for off in offsets], dim=-3)


# In the three helpers below heads form groups of c (= kernel.shape[1]); a kernel [H, c, c_q, c_k]
# gives each output head o of a group its taps over the group's heads i (or e), queries a, keys b.


def _fold_kernel_into_qk(
    q: torch.Tensor, k: torch.Tensor, kernel: torch.Tensor, q_pad: tuple[int, int], k_pad: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-softmax conv as one dot product: conv(q k^T)[i, j] = q'_i . k'_j, with q'_i the group's
    queries at i + alpha stacked over taps alpha and k'_j the kernel-weighted sum over key taps.

    q: [B, H, N, d], k: [B, H, M, d], kernel [H, c, c_q, c_k] -> q' [B, H, N, F], k' [B, H, M, F],
    F = c * c_q * d.
    """
    B, H, N, d = q.shape
    M = k.shape[2]
    _, c_in, c_q, c_k = kernel.shape
    G = H // c_in
    q_off, k_off = list(range(-q_pad[0], c_q - q_pad[0])), list(range(-k_pad[0], c_k - k_pad[0]))
    qs = _shifts(q.reshape(B, G, c_in, N, d), q_off)  # [B, G, c_in, c_q, N, d]
    qs = qs.permute(0, 1, 4, 2, 3, 5).reshape(B, G, 1, N, c_in * c_q * d).expand(B, G, c_in, N, -1)
    ks = _shifts(k.reshape(B, G, c_in, M, d), k_off)  # [B, G, c_in, c_k, M, d]
    w = kernel.to(k.dtype).view(G, c_in, c_in, c_q, c_k)  # [group, out, in, a, b]
    kf = torch.einsum("goiab,zgibmd->zgomiad", w, ks)
    F_ = c_in * c_q * d  # explicit widths here and below: -1 is ambiguous for B = 0
    return qs.reshape(B, H, N, F_), kf.reshape(B, H, M, F_)


def _stack_shifted_values(
    v: torch.Tensor, kernel: torch.Tensor, q_pad: tuple[int, int], k_pad: tuple[int, int]
) -> torch.Tensor:
    """Values for a post-softmax conv: for every head, its group's values shifted by every key tap
    (sum_j conv(A)[i, j] v_j = sum of taps of A[i + alpha, :] @ v[. - beta]).

    v: [B, H, M, d] -> [B, H, M, c * c_k * d]
    """
    B, H, M, d = v.shape
    _, c_in, _, c_k = kernel.shape
    G = H // c_in
    vs = _shifts(v.reshape(B, G, c_in, M, d), list(range(k_pad[0], k_pad[0] - c_k, -1)))  # v[j - beta]
    vs = vs.permute(0, 1, 4, 2, 3, 5).reshape(B, G, 1, M, c_in * c_k * d)
    return vs.expand(B, G, c_in, M, c_in * c_k * d).reshape(B, H, M, c_in * c_k * d)


def _combine_shifted_outputs(
    out: torch.Tensor, kernel: torch.Tensor, q_pad: tuple[int, int], k_pad: tuple[int, int]
) -> torch.Tensor:
    """Finish a post-softmax conv: shift each source head's outputs by the query taps and sum with
    the kernel. out: [B, H, N, c * c_k * d] (SDPA over ``_stack_shifted_values``) -> [B, H, N, d]."""
    B, H, N, width = out.shape
    _, c_in, c_q, c_k = kernel.shape
    G, d = H // c_in, width // (c_in * c_k)
    r = out.view(B, G, c_in, N, width)  # [B, G, e, N, o*b*d]
    rs = _shifts(r, list(range(-q_pad[0], c_q - q_pad[0])))  # [B, G, e, a, N, o*b*d]
    rs = rs.view(B, G, c_in, c_q, N, c_in, c_k, d)
    w = kernel.to(out.dtype).view(G, c_in, c_in, c_q, c_k)  # [group, out, in, a, b]
    return torch.einsum("goeab,zgeanobd->zgond", w, rs).reshape(B, H, N, d)


def lambda_init(layer_idx: int) -> float:
    """Depth-dependent init of Differential Transformer; heads are scaled by ``1 - lambda_init``."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


@register_attention("mta")
class MultiTokenAttention(HeadAttention):
    """Multi-Token Attention.

    Args (besides ``HeadAttention``'s):
        kq_conv: "pre" | "post" | None: key-query convolution before/after softmax, or none.
        head_conv: "pre" | "post" | None: head-mixing convolution before/after softmax, or none.
        q_kernel, k_kernel: key-query kernel size (c_q, c_k).
        head_kernel: heads per mixing group (c_h); must divide num_heads.
        group_norm: per-head RMS norm of the head outputs with depth scaling (uses ``layer_idx``;
            0 when the layer index is unknown, e.g. inside timm's VisionTransformer).
        causal: language-model masking (past-only query padding, double masking); forward's
            ``is_causal=True`` requires it.
        impl: "factorized" (default: the same result without building the [N, M] map, through
            SDPA; 2-3x faster on CPU at N=256..1024; taken by unmasked non-causal forwards without
            attention dropout, the others use the reference) or "reference" (explicit score map).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        kq_conv: str | None = "pre",
        head_conv: str | None = "post",
        q_kernel: int = 3,
        k_kernel: int = 3,
        head_kernel: int = 2,
        group_norm: bool = True,
        causal: bool = False,
        impl: str = "factorized",
        device=None,
        dtype=None,
        **kwargs,
    ) -> None:
        super().__init__(dim, num_heads, device=device, dtype=dtype, **kwargs)
        for name, stage in (("kq_conv", kq_conv), ("head_conv", head_conv)):
            if stage not in STAGES:
                raise ValueError(f"{name}={stage!r} is not known; use one of {STAGES}")
        for name, size in (("q_kernel", q_kernel), ("k_kernel", k_kernel), ("head_kernel", head_kernel)):
            if size < 1:
                raise ValueError(f"{name}={size} must be >= 1")
        if head_conv is not None and num_heads % head_kernel:
            raise ValueError(
                f"head_kernel={head_kernel} must divide num_heads={num_heads} (heads are mixed in groups of "
                f"head_kernel); choose a divisor of {num_heads} or head_conv=None"
            )
        dd = {"device": device, "dtype": dtype}
        self.kq_stage = kq_conv
        self.head_stage = head_conv
        self.causal = causal
        self.head_group = head_kernel if head_conv is not None else 1
        # Offset-0 tap of the key-query kernel: past-only queries when causal, centred otherwise.
        self.q_pad = (q_kernel - 1, 0) if causal else ((q_kernel - 1) // 2, q_kernel // 2)
        self.k_pad = ((k_kernel - 1) // 2, k_kernel // 2)

        self.kq_kernel = None
        self.head_mix = None
        if kq_conv is not None:
            # One 3-D kernel over (head group, query, key) when head mixing sits on the same side.
            heads_in = self.head_group if head_conv == kq_conv else 1
            kernel = torch.zeros(num_heads, heads_in, q_kernel, k_kernel, **dd)
            kernel[torch.arange(num_heads), torch.arange(num_heads) % heads_in, self.q_pad[0], self.k_pad[0]] = 1.0
            self.kq_kernel = nn.Parameter(kernel)
        if head_conv is not None and head_conv != kq_conv:
            # [H, c_h, 1, 1]: output head h mixes the c_h heads of its group (a 1x1 grouped conv).
            eye = torch.eye(self.head_group, **dd).repeat(num_heads // self.head_group, 1)
            self.head_mix = nn.Parameter(eye[:, :, None, None])
        self.head_norm = nn.RMSNorm(self.head_dim, eps=1e-5, **dd) if group_norm else None
        self.head_scale = 1.0 - lambda_init(self.layer_idx or 0)
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r} is not known; use one of {IMPLS}")
        self.impl = impl

    def stage_kernel(self, stage: str) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]] | None:
        """The convolution applied at ``stage`` ("pre"/"post" softmax): kernel [H, c_in, c_q, c_k]
        (c_in heads of the group read per output head) with its (query, key) zero padding, or None."""
        kq_kernel, head_mix = self.kq_kernel, self.head_mix
        if self.kq_stage == stage and kq_kernel is not None:
            return kq_kernel, self.q_pad, self.k_pad
        if self.head_stage == stage and head_mix is not None:
            return head_mix, (0, 0), (0, 0)
        return None

    def _mix(self, a: torch.Tensor, stage: str) -> torch.Tensor:
        """Apply the convolution of ``stage`` to a map [B, H, N, M]."""
        conv = self.stage_kernel(stage)
        if conv is None:
            return a
        kernel, q_pad, k_pad = conv
        kernel = kernel.to(a.dtype)
        return F.conv2d(F.pad(a, (*k_pad, *q_pad)), kernel, groups=self.num_heads // kernel.shape[1])

    def attention_weights(
        self, q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """Reference path. q: [B, H, N, d], k: [B, H_kv, M, d] -> weights [B, H, N, M]."""
        scores = dot_scores(q, k, self.scale, self.num_heads // self.num_kv_heads)
        mask = layer_mask(attn_mask, is_causal, self.causal, q.shape[-2], k.shape[-2], scores.dtype, scores.device)
        scores = add_mask(self._mix(zero_masked(scores, mask), "pre"), mask)
        weights = scores.softmax(dim=-1)
        if self.kq_stage == "post" or self.head_stage == "post":
            weights = zero_masked(self._mix(weights, "post"), mask)
        return weights

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """q: [B, H, N, d], k/v: [B, H_kv, M, d] -> [B, H, N, d]."""
        dropout = self.training and self.attn_drop.p > 0
        # Under torch.fx attn_mask is symbolic (not None), so a traced graph holds the reference path,
        # which takes any mask at run time (and equals the factorized one).
        if self.impl == "factorized" and attn_mask is None and not (self.causal or is_causal or dropout):
            out = self.factorized_heads(q, k, v)
        else:
            weights = self.attn_drop(self.attention_weights(q, k, attn_mask, is_causal))
            out = weights @ expand_kv_groups(v, self.num_heads // self.num_kv_heads).to(weights.dtype)
        head_norm = self.head_norm
        if head_norm is not None:
            out = head_norm(out) * self.head_scale
        return out

    def factorized_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Exact rewrite of the unmasked, non-causal path that never builds the [N, M] map.

        A pre-softmax conv of q.k^T is a dot product of stacked shifted queries with stacked
        kernel-weighted shifted keys (feature width c_in * c_q * d); a post-softmax conv of the
        weights equals attending to shifted values and summing shifted outputs. SDPA does the rest.
        q: [B, H, N, d], k/v: [B, H_kv, M, d] -> [B, H, N, d] (before the head norm).
        """
        H = self.num_heads
        groups = H // self.num_kv_heads
        k, v = expand_kv_groups(k, groups), expand_kv_groups(v, groups)
        pre, post = self.stage_kernel("pre"), self.stage_kernel("post")
        if pre is not None:
            q, k = _fold_kernel_into_qk(q, k, *pre)
        if post is not None:
            v = _stack_shifted_values(v, *post)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return out if post is None else _combine_shifted_outputs(out, *post)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, kq_conv={self.kq_stage}, head_conv={self.head_stage}, "
            f"head_group={self.head_group}, causal={self.causal}, group_norm={self.head_norm is not None}"
        )
