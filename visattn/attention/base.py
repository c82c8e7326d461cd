"""The multi-head attention every variant builds on, with timm's constructor and parameter names.

``HeadAttention`` is standard multi-head self-attention through ``F.scaled_dot_product_attention``
(grouped key/value heads when ``num_kv_heads < num_heads``), and takes Mixture-of-Head routing as
a capability: give it ``routed_topk`` (and ``shared_heads``) and a ``HeadRouter`` weights each
head's output per token before the output projection. Variants change how heads attend by
overriding ``attend``; routing, projections and the timm contract stay here.
"""

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from .fused_gating import GatedMerge, gated_merge_runs, gated_projection, gated_projection_runs
from .routing import HeadRouter
from .small_heads import (
    small_attention_fits,
    small_attention_gated,
    small_attention_runs,
    small_attention_train,
)
from .tracing import autocast_enabled, keeps_stats


def resolve_head_dim(dim: int, num_heads: int, head_dim: int | None, attn_head_dim: int | None) -> int:
    """Head width: explicit ``head_dim`` (ours) or ``attn_head_dim`` (timm's name), else dim / heads."""
    if num_heads < 1:
        raise ValueError(f"num_heads={num_heads} must be >= 1")
    if head_dim is not None and attn_head_dim is not None and head_dim != attn_head_dim:
        raise ValueError(f"head_dim={head_dim} and attn_head_dim={attn_head_dim} disagree; give one of them")
    head_dim = head_dim if head_dim is not None else attn_head_dim
    if head_dim is None:
        if dim % num_heads:
            raise ValueError(
                f"dim={dim} is not divisible by num_heads={num_heads}; choose num_heads among the divisors "
                f"of {dim} or give head_dim explicitly"
            )
        head_dim = dim // num_heads
    if head_dim < 1:
        raise ValueError(f"head_dim={head_dim} must be >= 1")
    return head_dim


class HeadAttention(nn.Module):
    """Multi-head self-attention. x: [B, N, C] -> [B, N, dim_out].

    ``swappable``: whether ``swap_attention`` may replace the layer (False for token mixers that are
    part of a model's design, e.g. TransNeXt's aggregated attention).

    Args (timm's ``Attention`` keywords, plus ours):
        num_kv_heads: key/value heads (GQA); ``None`` = ``num_heads`` (MHA), 1 = MQA.
        head_dim / attn_head_dim: per-head width; the inner width ``num_heads * head_dim`` may differ
            from ``dim`` (MoH-DiT-XL uses 72).
        shared_heads, routed_topk, two_stage, router, gate, routing: Mixture-of-Head routing
            (see ``HeadRouter``); routing is on when ``routed_topk`` is given.
        layer_idx, depth: position of the layer, for variants whose initialisation depends on it.
    """

    swappable: bool = True
    # Evaluated annotations (no ``from __future__ import annotations`` in this file): TorchScript
    # reads them to type the attributes forward writes.
    stats: dict[str, torch.Tensor]
    __jit_unused_properties__ = ["active_heads", "aux_loss"]

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        *,
        head_dim: int | None = None,
        attn_head_dim: int | None = None,
        dim_out: int | None = None,
        num_kv_heads: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_norm: bool = False,
        proj_bias: bool = True,
        gated: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: type[nn.Module] | None = None,
        shared_heads: int | None = None,
        routed_topk: int | None = None,
        two_stage: bool | None = None,
        router: str = "linear",
        gate: str = "soft",
        routing: str = "token_choice",
        layer_idx: int | None = None,
        depth: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        self.head_dim = resolve_head_dim(dim, num_heads, head_dim, attn_head_dim)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if not 1 <= num_kv_heads <= num_heads or num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads} (1 = MQA, {num_heads} = MHA)"
            )
        if (qk_norm or scale_norm) and norm_layer is None:
            norm_layer = nn.LayerNorm
        self.dim = dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.attn_dim = num_heads * self.head_dim
        self.kv_dim = num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.depth = depth

        self.qkv = nn.Linear(dim, self.attn_dim + 2 * self.kv_dim, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out or dim, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        # softmax heads through ``sdpa``: a gated forward may then skip the rows whose gate is 0 (dense_forward)
        self.attends_by_sdpa = type(self).attend is HeadAttention.attend
        # what ``sdpa`` trains on: "sdpa", or "small_attention" (the compiled kernel and its backward, where it
        # runs), which only a run's start-up probe sets (visattn.attention.train_paths)
        self.train_attention = "sdpa"

        if routed_topk is None and shared_heads is not None:
            raise ValueError(f"shared_heads={shared_heads} was given without routed_topk; give both to route heads")
        if routed_topk is None and routing != "token_choice":
            raise ValueError(f"routing={routing!r} was given without routed_topk; give routed_topk to route heads")
        self.router = (
            HeadRouter(dim, num_heads, shared_heads or 0, routed_topk, two_stage, router, gate, routing, **dd)
            if routed_topk is not None
            else None
        )
        # whether a head gated 0 has no gradient through its gate (soft gates: the unselected heads' gates are 0
        # whatever the scores), so a path may skip it in training too (straight-through gates pass one to it)
        self.zero_gates_carry_no_grad = gate == "soft"
        # Per-forward statistics for load plots (detached); see visattn.attention_stats.
        self.stats = {}
        # With gradients, the linear router's logits come out of the qkv matmul as extra output
        # columns: backward then runs one weight and one input gradient matmul instead of two each
        # (the study's ViT trained about 2% faster). Padded to a multiple of 16 columns (the matmul's vector
        # width: 10 extra columns cost more than 16). Without gradients the router's own matmul on
        # the freshly read x is as fast in float32; under autocast it is not (dense_forward).
        self.router_columns = 0
        if self.router is not None and self.router.logit_rows and type(self).project_qkv is HeadAttention.project_qkv:
            self.router_columns = -(-self.router.logit_rows // 16) * 16

    @property
    def active_heads(self) -> tuple[int, int]:
        """(heads active per token, heads) of this layer."""
        active = self.router.active_heads if self.router is not None else self.num_heads
        return active, self.num_heads

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """Load-balancing loss of the last training forward, or None when the layer does not route."""
        return self.router.aux_loss if self.router is not None else None

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [B, N, C] -> q [B, H, N, d], k and v [B, H_kv, N, d]."""
        return self.project_equal_heads(x)

    def project_equal_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``project_qkv`` for heads of equal width (callable by variants that override it).
        x: [B, N, C] -> q [B, H, N, d], k and v [B, H_kv, N, d]."""
        B, N, _ = x.shape
        q, k, v = self.qkv(x).split([self.attn_dim, self.kv_dim, self.kv_dim], dim=-1)
        q = q.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return self.q_norm(q), self.k_norm(k), v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """Per-head attention. q: [B, H, N, d], k/v: [B, H_kv, M, d] -> [B, H, N, d]."""
        return self.sdpa(q, k, v, attn_mask, is_causal)

    def sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        scale: float | None = None,
        row_gates: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Softmax attention through SDPA with this layer's dropout and key/value grouping (what
        ``attend`` does; variants call it after changing q/k, since TorchScript has no ``super()``).
        q: [B, H, N, d], k/v: [B, H_kv, M, d] -> [B, H, N, d]. Small heads in eval may run in the compiled
        kernel instead, where the running machine computes them faster (``visattn.attention.small_heads``);
        it then skips the query rows whose ``row_gates`` [B, N, H] are 0 (their output is 0 there), which only
        a caller that multiplies the heads by those gates may pass. With gradients the kernel runs where
        ``train_attention`` says so."""
        return self.gated_sdpa(q, k, v, attn_mask, is_causal, scale, row_gates, False)[0]

    def gated_sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        is_causal: bool,
        scale: float | None,
        row_gates: torch.Tensor | None,
        scale_rows: bool,
    ) -> tuple[torch.Tensor, bool]:
        """``sdpa``, and with ``scale_rows`` the heads multiplied by ``row_gates`` where the small-heads kernel runs
        (it scales each row as it writes it, so the merge is a view; the gates' gradient comes from its backward,
        0 at the rows gated 0: soft gates only). -> (heads [B, H, N, d], whether they are gated)."""
        dropout_p = self.attn_drop.p if self.training else 0.0
        if not torch.jit.is_scripting():
            if small_attention_runs(q, k, v, attn_mask, is_causal, dropout_p):
                return small_attention_gated(q, k, v, scale, row_gates, scale_rows)
            if self.train_attention == "small_attention" and small_attention_fits(
                q, k, v, attn_mask, is_causal, dropout_p
            ):
                return small_attention_train(q, k, v, scale, row_gates, scale_rows)
        heads = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return heads, False

    def merge_heads(self, x: torch.Tensor, heads: torch.Tensor, gates: torch.Tensor | None) -> torch.Tensor:
        """heads: [B, H, N, d] weighted by gates [B, N, H] -> output [B, N, dim_out]."""
        return self.merge_equal_heads(x, heads, gates)

    def merge_equal_heads(self, x: torch.Tensor, heads: torch.Tensor, gates: torch.Tensor | None) -> torch.Tensor:
        """``merge_heads`` for heads of equal width (callable by variants that override it).
        heads: [B, H, N, d] weighted by gates [B, N, H] -> output [B, N, dim_out]."""
        B, H, N, d = heads.shape
        if gates is not None and not torch.jit.is_scripting():
            proj = self.proj
            if (type(proj) is nn.Linear and type(self.norm) is nn.Identity and self.gate is None
                    and gated_projection_runs(heads, gates, proj.weight, proj.bias)):
                # merge and projection per block of tokens (visattn.attention.fused_gating)
                return self.proj_drop(gated_projection(heads, gates, proj.weight, proj.bias))
        if gates is not None and not torch.is_grad_enabled():
            # without gradients one product writes the merged layout, where gating the heads in place and then the
            # transpose's copy were two passes over them (on a GPU, two kernels)
            merged = torch.empty((B, N, H, d), dtype=heads.dtype, device=heads.device)
            torch.mul(heads.transpose(1, 2), gates.to(heads.dtype).unsqueeze(-1), out=merged)
            return self.finish_merge(x, merged.view(B, N, H * d))
        if gates is not None and not torch.jit.is_scripting():
            if gated_merge_runs(heads, gates):  # one pass each way (visattn.attention.fused_gating)
                return self.finish_merge(x, GatedMerge.apply(heads, gates))
        out = heads.transpose(1, 2).reshape(B, N, H * d)  # explicit width: -1 is ambiguous for B = 0
        if gates is not None:
            # gates repeated over each head's width: a product of equal shapes and its backward run 2-3x
            # faster on CPU than one broadcast over a last dimension of d (2-3% of a study layer's step)
            out = out * gates.to(out.dtype).unsqueeze(-1).expand(B, N, H, d).reshape(B, N, H * d)
        return self.finish_merge(x, out)

    def finish_merge(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The merged heads out: [B, N, H * d] through the head norm, output gate and projection
        (x: [B, N, C], the layer's input) -> [B, N, dim_out]."""
        out = self.norm(out)
        gate = self.gate
        if gate is not None:
            out = out * gate(x).sigmoid()
        return self.proj_drop(self.proj(out))

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """x: [B, N, C]; attn_mask broadcastable to [B, H, N, N] (bool: True = attend) -> [B, N, dim_out]."""
        return self.dense_forward(x, attn_mask, is_causal)

    def dense_forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        """Every head computed, unselected heads zeroed by their gates (``forward``'s path; variants
        with other paths fall back to it). x: [B, N, C] -> [B, N, dim_out]."""
        if self.router_columns and torch.is_grad_enabled():
            q, k, v, logits = self.project_qkv_and_logits(x)
            gates, _ = self.route(x, q, selection=False, logits=logits)
        else:
            if self.router_columns and not torch.jit.is_scripting() and self.autocast_on(x):
                # Under autocast the qkv and the router's matmuls would each cast x (the second cast was
                # most of the router's cost at ViT-S in bf16), so x is cast once, as autocast would. The
                # logits do not come from the qkv matmul here: their 7 extra columns misalign its rows,
                # which made the matmul and SDPA on its q/k/v views 2-3 ms slower (docs/benchmarks.md).
                x = x.to(torch.get_autocast_dtype(x.device.type))
            router = self.router
            early = False  # nested, not `and`: TorchScript skips the body only of an `if` on a None module
            if router is not None:
                early = router.router_kind == "linear"
            if early:
                # before the qkv matmul, which reads x too: the router then finds x where the layer's norm left
                # it in cache (the study ViT inferred 1.7% faster, 41 paired rounds; docs/benchmarks.md)
                gates, _ = self.route(x, None, selection=False)
                q, k, v = self.project_qkv(x)
            else:
                q, k, v = self.project_qkv(x)
                gates, _ = self.route(x, q, selection=False)
        if gates is not None and self.attends_by_sdpa:
            # Each head is multiplied by its gate, so the rows gated 0 need not be attended, and where the small-heads
            # kernel runs it multiplies the rows as it writes them (the study's MoH models trained 1-2% faster than
            # with the gated projection after it; docs/benchmarks.md). With gradients only where a gate of 0 has no
            # gradient: a straight-through gate passes one to every head's output, which needs every head attended.
            skip = self.zero_gates_carry_no_grad or not torch.is_grad_enabled()
            heads, gated = self.gated_sdpa(q, k, v, attn_mask, is_causal, None, gates if skip else None, skip)
            return self.merge_heads(x, heads, None if gated else gates)
        heads = self.attend(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        return self.merge_heads(x, heads, gates)

    @torch.jit.unused
    def autocast_on(self, x: torch.Tensor) -> bool:
        """Whether autocast is on for x's device (False while torch.fx traces: a Proxy has no device)."""
        return not isinstance(x, torch.fx.Proxy) and autocast_enabled(x.device.type)

    def project_qkv_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``project_equal_heads`` and the linear router's logits [logit_rows, B*N] (float32) from
        one matmul (``linear_with_logits`` on qkv's weight)."""
        B, N, C = x.shape
        parts, logits = self.linear_with_logits(x, [self.qkv.weight], self.qkv.bias,
                                                [self.attn_dim, self.kv_dim, self.kv_dim])
        q = parts[0].view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        k = parts[1].view(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = parts[2].view(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return self.q_norm(q), self.k_norm(k), v, logits

    def linear_with_logits(
        self, x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None, widths: list[int]
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """x: [B, N, C] through ``weights`` stacked ([sum(widths), C] in all, ``bias`` [sum(widths)] or
        None) and the linear router in one matmul: the router's rows appended (bias 0 there), zero rows
        up to ``router_columns``. -> (the output split by ``widths``, views [B, N, w], and the router's
        logits [logit_rows, B*N] float32, a strided view the routing kernel reads in place)."""
        router = self.router
        assert router is not None
        B, N, C = x.shape
        columns = self.router_columns
        stacked = router.stacked_weight(columns, above=weights)
        assert stacked is not None
        if bias is not None:
            bias = torch.cat([bias, bias.new_zeros(columns)])
        rows = router.logit_rows
        # one split (not slices): its backward assembles the output's gradient in one pass
        parts = F.linear(x, stacked, bias).split(widths + [rows, columns - rows], dim=-1)
        logits = parts[len(widths)].reshape(B * N, rows).t().float()
        return [parts[i] for i in range(len(widths))], logits  # indexed: torch.fx cannot iterate a Proxy

    def route(
        self, x: torch.Tensor, q: torch.Tensor | None, selection: bool = True, logits: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Head gates [B, N, H] and selection [B, N, H] for tokens x: [B, N, C] (None, None without
        routing; the selection None when ``selection`` is False); ``logits``: the router's, when
        computed with the queries (``project_qkv_and_logits``). Records the per-sample head load in
        ``stats``."""
        router = self.router
        if router is None:
            return None, None
        gates, selected = router(x, q, selection, logits)
        load = router.head_load
        if load is not None and keeps_stats():
            self.stats["head_load"] = load
        return gates, selected

    def extra_repr(self) -> str:
        kv = f", kv_heads={self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        return f"dim={self.dim}, heads={self.num_heads}, head_dim={self.head_dim}{kv}"
