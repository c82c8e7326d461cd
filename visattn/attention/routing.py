"""Mixture-of-Head routing: per-token weights over attention heads (MoH, arXiv 2410.11842).

The router turns tokens ``x: [B, N, C]`` into gates ``[B, N, H]`` that weight each head's output
before the output projection. Heads ``0 .. shared_heads-1`` are always on; the remaining pool of
``E = H - shared_heads`` heads is routed, ``routed_topk`` of them per token.

Scales follow the released MoH code, so its checkpoints give the same outputs:
routed gates are renormalised over the chosen heads and multiplied by ``k``, shared gates by
``shared_heads``, and the two-stage weights ``[alpha1, alpha2]`` by 2, so every active head weighs
about 1 at initialisation. A layer with ``routed_topk=0`` is dense: every head on, with soft
per-token weights (softmax over heads, times H).

Two ways to pick the routed (token, head) pairs (``routing``):

- ``"token_choice"`` (MoH): every token takes its top ``routed_topk`` heads of the pool by
  ``P = softmax(W_r x_t)``; the gates are P renormalised over the chosen heads, times k.
- ``"head_choice"`` (static shapes, as expert-choice routing): every routed head takes the
  ``c = round(N * routed_topk / E)`` tokens of each image with the highest ``P_i`` (at least 1, at
  most N), so a token uses ``shared_heads + routed_topk`` heads on average, the same budget as token
  choice, but how many heads one token gets varies (0..E) while every head's load is fixed. The gate
  is MoH's formula without renormalisation, ``g_i = alpha2 * P_i * E`` for a chosen pair (0 else):
  ``P_i`` is about 1/E at initialisation, so the factor E makes a chosen head weigh about 1 as in token
  choice; renormalising over "the chosen heads of a token" would give a token chosen by one head
  that head at full weight whatever its score. Gradients reach ``W_r`` through ``P_i``. Every head's
  load is balanced by construction, so head choice stores no load-balancing loss (``aux_loss`` stays
  None, and ``visattn.aux_loss`` counts it as 0).
"""

from collections.abc import Callable

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_function

from visattn.kernels import build_id, moh_cuda_gates_op, moh_router_gates_op, moh_router_logits_op

from .fused_gating import RoutedGatesCuda, eager_cpu_kernels, eager_cuda_gates, needs_grad, routed_gates
from .impl_probe import ImplProbe, default_disk_dir, device_name
from .tracing import keeps_stats

ROUTERS = ("linear", "l2norm")
GATES = ("soft", "binary_ste")
ROUTINGS = ("token_choice", "head_choice")


def validate_budget(num_heads: int, shared_heads: int, routed_topk: int) -> None:
    """Raise ValueError unless (shared_heads, routed_topk) is a valid budget for num_heads heads."""
    if not 0 <= shared_heads <= num_heads:
        raise ValueError(f"shared_heads={shared_heads} must be in [0, num_heads={num_heads}]")
    pool = num_heads - shared_heads
    if routed_topk == 0:
        if shared_heads != num_heads:
            raise ValueError(
                f"routed_topk=0 makes the layer dense (every head on, soft weights), so shared_heads "
                f"must equal num_heads={num_heads}, got {shared_heads}; or set routed_topk in [1, {pool}]"
            )
        return
    if not 1 <= routed_topk <= pool:
        raise ValueError(
            f"routed_topk={routed_topk} is outside [0, {pool}]: the routed pool is num_heads - shared_heads "
            f"= {num_heads} - {shared_heads} = {pool} heads"
        )


def default_budget(num_heads: int, shared_heads: int | None = None) -> tuple[int, int]:
    """MoH's budget when none is given: half the heads shared, half of the remaining pool routed."""
    shared = num_heads // 2 if shared_heads is None else shared_heads
    pool = num_heads - shared
    return shared, (max(1, pool // 2) if pool > 0 else 0)


def head_capacity(tokens: int, routed_topk: int, pool: int) -> int:
    """Tokens of an image each routed head takes under head choice: round(tokens * routed_topk / pool),
    at least 1 and at most ``tokens`` (0 for an image of no tokens). Halves round up."""
    if tokens == 0:
        return 0
    return min(tokens, max(1, int(tokens * routed_topk / pool + 0.5)))


@torch.fx.wrap
@register_notrace_function  # a leaf for torch.fx: the capacity depends on the (symbolic) token count
def head_choice_selection(probs: torch.Tensor, routed_topk: int, pool: int) -> torch.Tensor:
    """probs [..., N] (a routed head's probabilities over one image's N tokens in each row) -> bool, the
    same shape: True for the row's ``head_capacity`` highest, ties to the lower token index (NaN above
    any number). Deterministic, so the compiled selection (``moh_head_choice``: topk and sort cost ten
    times the row's work on a CPU) and the PyTorch one below choose the same tokens."""
    N = probs.shape[-1]
    capacity = head_capacity(N, routed_topk, pool)
    if not torch.jit.is_scripting():
        compiled = _compiled_head_choice(probs, capacity)
        if compiled is not None:
            return compiled
    _, order = probs.sort(dim=-1, descending=True, stable=True)
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, order[..., :capacity], True)


def image_head_load(keep: torch.Tensor, B: int, N: int, S: int) -> torch.Tensor:
    """keep [E, B*N] (1 where a token chose routed head e, float) -> [B, S + E]: each image's share of
    tokens per head, 1 for the S shared heads (``head_load``)."""
    if not torch.jit.is_scripting():
        compiled = _compiled_head_load(keep, N, S)
        if compiled is not None:
            return compiled
    return F.pad(keep.view(keep.shape[0], B, N).mean(2), (0, 0, S, 0), value=1.0).t()


@torch.jit.unused
def _compiled_head_load(keep: torch.Tensor, N: int, S: int) -> torch.Tensor | None:
    """``image_head_load`` by the compiled op (``moh_head_load``: a few us where ATen's mean, pad and
    transpose took 86 at the study ViT's size, more than the routing pass), or None where it does not run."""
    if N == 0 or keep.dtype != torch.float32 or not eager_cpu_kernels(keep):
        return None
    return torch.ops.visattn.moh_head_load(keep, N, S)


@torch.jit.unused
def _compiled_head_choice(probs: torch.Tensor, capacity: int) -> torch.Tensor | None:
    """``head_choice_selection`` by the compiled kernel, or None where it does not run."""
    if probs.dtype != torch.float32 or not eager_cpu_kernels(probs):
        return None
    return torch.ops.visattn.moh_head_choice(probs.reshape(-1, probs.shape[-1]), capacity).view(probs.shape)


class HeadRouter(nn.Module):
    """Per-token head gates for ``num_heads`` heads.

    Args:
        dim: token width C seen by the router.
        num_heads: H.
        shared_heads: always-on heads (the first ones by index).
        routed_topk: routed heads chosen per token; 0 makes the layer dense with soft weights.
        two_stage: weight shared vs routed heads per token by ``softmax(W_h x) * 2``.
        router: ``"linear"`` (learned logits ``W_r x``) or ``"l2norm"`` (parameter-free: the l2 norm
            of each routed head's query, for continue-tuning a pretrained MHA model).
        gate: ``"soft"`` (weighted sum) or ``"binary_ste"`` (exact 0/1 gates forward,
            straight-through gradients to the soft scores backward).
        routing: ``"token_choice"`` (each token picks ``routed_topk`` heads) or ``"head_choice"``
            (each routed head picks a fixed share of each image's tokens; see the module docstring).

    Parameter names: ``routed`` (the release's ``wg``), ``mix`` (``wg_0``), ``shared`` (``wg_1``).
    Scriptable with ``torch.jit.script`` (the attributes set by forward are declared below).
    """

    # Set by forward, read by visattn.aux_loss / attention_stats; per instance, never shared.
    # Evaluated annotations (no ``from __future__ import annotations`` here): TorchScript reads them.
    aux_loss: torch.Tensor | None
    head_load: torch.Tensor | None
    __jit_unused_properties__ = ["active_heads"]

    def __init__(
        self,
        dim: int,
        num_heads: int,
        shared_heads: int,
        routed_topk: int,
        two_stage: bool | None = None,
        router: str = "linear",
        gate: str = "soft",
        routing: str = "token_choice",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"router={router!r} is not known; use one of {ROUTERS}")
        if gate not in GATES:
            raise ValueError(f"gate={gate!r} is not known; use one of {GATES}")
        if routing not in ROUTINGS:
            raise ValueError(f"routing={routing!r} is not known; use one of {ROUTINGS}")
        validate_budget(num_heads, shared_heads, routed_topk)
        learned_mix = router == "linear" and gate == "soft"
        if two_stage is None:
            two_stage = learned_mix
        if two_stage and not learned_mix:
            raise ValueError(
                f"two_stage=True needs router='linear' and gate='soft' (got router={router!r}, gate={gate!r}): "
                "the l2norm router has no parameters and binary gates are exactly 0/1; set two_stage=False"
            )
        if router == "l2norm" and routed_topk == 0:
            raise ValueError("router='l2norm' routes heads; routed_topk=0 (dense soft weights) needs router='linear'")
        self.num_heads = num_heads
        self.shared_heads = shared_heads
        self.routed_topk = routed_topk
        self.pool = num_heads - shared_heads if routed_topk > 0 else 0
        self.router_kind = router
        self.gate_mode = gate
        self.routing = routing
        self.two_stage = two_stage and shared_heads > 0 and routed_topk > 0
        dd = {"device": device, "dtype": dtype}
        linear = router == "linear"
        self.routed = nn.Linear(dim, self.pool, bias=False, **dd) if linear and self.pool > 0 else None
        self.mix = nn.Linear(dim, 2, bias=False, **dd) if self.two_stage else None
        self.shared = nn.Linear(dim, shared_heads, bias=False, **dd) if linear and shared_heads > 1 else None
        self.eps = torch.finfo(torch.float32).eps  # floor of the renormalisation (probs are float32)
        # rows of the linear routers' stacked logits (see ``stacked_weight``): shared, routed pool, mix
        self.logit_rows = sum(m.out_features for m in (self.shared, self.routed, self.mix) if m is not None)
        # token choice's ranking constants (``top_k_mask``); not in the state dict, empty where unused
        ranked = routing == "token_choice" and 0 < routed_topk < self.pool
        pairs, weight, bias = rank_constants(self.pool if ranked else 0, routed_topk, device)
        self.register_buffer("rank_pairs", pairs, persistent=False)
        self.register_buffer("rank_weight", weight, persistent=False)
        self.register_buffer("rank_bias", bias, persistent=False)
        self.aux_loss = None
        self.head_load = None

    def __getstate__(self) -> dict:
        """State for ``copy.deepcopy`` and pickling: the last load-balancing loss without its autograd
        graph (a non-leaf tensor cannot be deep-copied, which broke copying a model after a training
        forward, e.g. for an EMA); the original keeps its graph for the training loss."""
        state = self.__dict__.copy()
        if state.get("aux_loss") is not None:
            state["aux_loss"] = state["aux_loss"].detach()
        return state

    @property
    def active_heads(self) -> int:
        return self.shared_heads + self.routed_topk

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, shared={self.shared_heads}, topk={self.routed_topk}, "
            f"router={self.router_kind}, gate={self.gate_mode}, two_stage={self.two_stage}, routing={self.routing}"
        )

    def stacked_weight(self, rows: int = 0, above: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """The linear routers' weights stacked [shared; routed; mix] ([logit_rows, C]), zero rows
        appended up to ``rows``, and the weights ``above`` ([M_i, C] each) stacked on top when given (one
        concatenation); None without a linear router. Concatenated per call (a few hundred values), so
        parameters, state_dict and optimiser state stay per router."""
        weights: list[torch.Tensor] = []
        if above is not None:
            weights.extend(above)
        shared = self.shared
        if shared is not None:
            weights.append(shared.weight)
        routed = self.routed
        if routed is not None:
            weights.append(routed.weight)
        mix = self.mix
        if mix is not None:
            weights.append(mix.weight)
        if len(weights) == (0 if above is None else len(above)):
            return None
        if rows > self.logit_rows:
            weights.append(weights[-1].new_zeros((rows - self.logit_rows, weights[-1].shape[1])))
        return weights[0] if len(weights) == 1 else torch.cat(weights, 0)

    def linear_weights(self) -> list[torch.Tensor]:
        """The linear routers' weights in ``stacked_weight``'s row order ([R_i, C] each; empty without one)."""
        return [m.weight for m in (self.shared, self.routed, self.mix) if m is not None]

    def _logits(self, x: torch.Tensor, float32: bool = True) -> torch.Tensor | None:
        """Every linear router's logits in one matmul, head-major: [shared; routed; mix] x tokens
        ([logit_rows, B*N], float32, or the matmul's dtype without ``float32``), or None without a linear
        router. A token-major product viewed head-major (strides (1, logit_rows)): MKL ran x @ W^T twice as
        fast as W @ x^T at ViT-S and DiT-B sizes (1.1 against 2.4 ms a DiT-B layer), and the routing
        kernels read either layout."""
        weight = self.stacked_weight()
        if weight is None:
            return None
        B, N, C = x.shape
        if torch.jit.is_scripting():
            logits = F.linear(x.reshape(B * N, C), weight).t()
        else:
            logits = router_linear(x.reshape(B * N, C), weight).t()
        return logits.float() if float32 else logits

    def _scores(self, x: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor | None, start: int) -> torch.Tensor:
        """Routed pool scores [E, B*N]: the linear router's logits from row ``start``, or the l2 norm of
        each routed head's query."""
        if self.routed is not None and logits is not None:
            return logits[start : start + self.pool]
        if q is None:
            raise ValueError("router='l2norm' needs the queries: call forward(x, q)")
        norms = torch.linalg.vector_norm(q[:, self.shared_heads :].float(), dim=-1)  # [B, E, N]
        return norms.transpose(0, 1).reshape(self.pool, x.shape[0] * x.shape[1])

    def forward(
        self, x: torch.Tensor, q: torch.Tensor | None = None, selection: bool = True,
        logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: [B, N, C], q: [B, H, N, d] (only the l2norm router reads it); ``logits``: the linear
        routers' logits [logit_rows, B*N] when the caller computed them (``stacked_weight`` times x), else
        computed here.

        Returns gates [B, N, H] (float32, contiguous; zero where a head is off) and the boolean
        selection [B, N, H] (True for shared heads and the chosen routed heads); None for the
        selection when ``selection`` is False (the masked dense path reads the gates only).

        Computed head-major ([heads, tokens]): on a CPU, softmax and top-k over a last dimension of
        a few heads loop per token and cost ten times this whole computation at the study's sizes.
        """
        if not torch.jit.is_scripting():
            fused = self._compiled_gates(x, selection, logits)
            if fused is not None:
                return fused
        B, N, _ = x.shape
        T = B * N
        S, E, k = self.shared_heads, self.pool, self.routed_topk
        if logits is None:
            logits = self._logits(x)
        if logits is not None:  # head-major rows for the slicing below
            logits = logits.contiguous()
        binary = self.gate_mode == "binary_ste"
        parts: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []  # the routed pool's selection as 0/1 floats [E, T]
        shared_lin = self.shared
        alpha: torch.Tensor | None = None  # two-stage weights of shared and routed heads, times 2
        if self.mix is not None and logits is not None:
            alpha = torch.softmax(logits[-2:], 0) * 2  # the mix rows come last
        if S > 0:
            if shared_lin is not None and logits is not None:
                soft = torch.softmax(logits[:S], 0)
                if alpha is not None:  # the per-token factors folded on [1, T] rows first
                    parts.append(soft * (alpha[:1] * S))
                elif binary:
                    soft = soft * S
                    parts.append(1.0 + (soft - soft.detach()))  # exactly 1 forward
                else:
                    parts.append(soft * S)
            else:
                parts.append(x.new_ones((S, T), dtype=torch.float32) if alpha is None else alpha[:1])
        if E > 0:
            probs = torch.softmax(self._scores(x, q, logits, S if shared_lin is not None else 0), 0)
            if self.routing == "head_choice":
                mask = head_choice_selection(probs.view(E, B, N), k, E).view(E, T).to(probs.dtype)
            else:
                # NaN (a non-finite input) ranks first, as topk ranks it, so every token keeps k heads
                ranked = torch.nan_to_num(probs, nan=2.0) if selection else probs
                mask = torch.ones_like(probs) if k >= E else top_k_mask(ranked, self.rank_pairs, self.rank_weight, self.rank_bias)
                if self.training and self.routed is not None:
                    # Released code's scale: E * sum_i f_i P_i over all B*N tokens (beta = 0.01 tuned for it).
                    self.aux_loss = (mask.mean(1) * probs.mean(1)).sum() * E
            masks.append(mask)
            if binary:
                routed = mask + (probs - probs.detach())
            elif self.routing == "head_choice":
                routed = probs * mask * E if alpha is None else probs * mask * (alpha[1:] * E)
            else:
                kept = probs * mask
                denom = kept.sum(0, keepdim=True).clamp_min(self.eps)
                routed = kept / denom * k if alpha is None else kept * (alpha[1:] * k / denom)
            parts.append(routed)
        # [T, H] contiguous: multiplying heads [B, N, H, d] by it is 1.8x faster than by a strided view
        gates = (parts[0] if len(parts) == 1 else torch.cat(parts, 0)).t().contiguous().view(B, N, self.num_heads)
        if keeps_stats():  # [B, H]: the shared heads' rows are 1
            if len(masks) == 0:
                self.head_load = x.new_ones((B, self.num_heads), dtype=torch.float32)
            else:
                self.head_load = image_head_load(masks[0], B, N, S)
        else:
            self.head_load = None
        if not selection:
            return gates, None
        if len(masks) == 0:
            return gates, x.new_ones((B, N, self.num_heads), dtype=torch.bool)
        chosen = torch.cat([x.new_ones((S, T), dtype=torch.bool), masks[0] > 0.5], 0)
        return gates, chosen.view(self.num_heads, B, N).permute(1, 2, 0)


    @torch.jit.unused
    def _compiled_gates(
        self, x: torch.Tensor, selection: bool, logits: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``forward``'s result from the compiled kernels (``visattn.kernels``; with gradients through
        ``RoutedGates`` on a CPU and ``RoutedGatesCuda`` on a GPU, which also give the load-balancing loss), or
        None where the PyTorch code below runs: binary gates, the l2norm router, a dense layer of one shared
        head; head choice with gradients (on a GPU head choice at all), and where ``eager_cpu_kernels`` or
        ``eager_cuda_gates`` says no (torch.compile / fx tracing, a Python dispatch mode such as the FLOP
        counter, no kernel on this machine)."""
        # a dense layer (routed_topk=0) has no pool: its soft weights need the shared router
        linear = self.routed is not None or (self.pool == 0 and self.shared is not None)
        if self.gate_mode != "soft" or not linear:
            return None
        cuda_gates = moh_cuda_gates_op() if eager_cuda_gates(x) else None
        if cuda_gates is None and not eager_cpu_kernels(x):
            return None
        B, N, _ = x.shape
        S, E = self.shared_heads, self.pool
        head_choice = self.routing == "head_choice" and E > 0  # a dense layer routes no pool either way
        budget = (S, E, self.routed_topk, self.mix is not None, self.shared is not None, self.eps)
        balanced = self.training and E > 0  # the load-balancing loss of a routed pool
        if cuda_gates is not None:
            if head_choice or N == 0:
                return None
            if logits is None:
                logits = self._logits(x, float32=False)  # the kernel reads any float dtype
            assert logits is not None
            if balanced or needs_grad(self, x):
                gates, keep, load, aux = RoutedGatesCuda.apply(logits, cuda_gates, budget, N, balanced)
                if balanced:
                    self.aux_loss = aux
            else:
                gates, keep, load = cuda_gates(logits, *budget, N)
            return self._gates_out(gates, keep, B, N, selection, load)
        if head_choice and (N == 0 or needs_grad(self, x)):
            return None  # head choice's compiled gates have no backward
        if logits is None and N > 0 and not head_choice and not balanced and not needs_grad(self, x):
            # inference: the logits and the gates in one kernel, where router_linear would take the kernels' loops
            stats = keeps_stats()
            fused = router_gates(x.reshape(B * N, x.shape[2]), self.linear_weights(), budget, N if stats else 0)
            if fused is not None:
                gates, keep, load = fused
                return self._gates_out(gates, keep, B, N, selection, load if stats else None, stats)
        if logits is None:
            logits = self._logits(x)
        assert logits is not None
        if head_choice:
            gates, keep = torch.ops.visattn.moh_head_choice_gates(
                logits, S, E, head_capacity(N, self.routed_topk, E), N, self.mix is not None, self.shared is not None
            )
        else:
            gates, keep, aux = routed_gates(logits, budget, balanced)
            if balanced:
                self.aux_loss = aux
        return self._gates_out(gates, keep, B, N, selection)

    @torch.jit.unused
    def _gates_out(
        self, gates: torch.Tensor, keep: torch.Tensor, B: int, N: int, selection: bool,
        load: torch.Tensor | None = None, stats: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kernels' gates [B*N, H] and keep [E, B*N] as ``forward`` returns them, recording the head load
        (``load`` [B, H] where the kernel computed it; ``stats``: ``keeps_stats()`` where the caller asked)."""
        S = self.shared_heads
        if not (keeps_stats() if stats is None else stats):
            self.head_load = None
        else:
            self.head_load = load if load is not None else image_head_load(keep, B, N, S)
        if not selection:
            return gates.view(B, N, self.num_heads), None
        chosen = torch.cat([keep.new_ones((S, B * N), dtype=torch.bool), keep > 0.5], 0)  # as below: [H, T] viewed
        return gates.view(B, N, self.num_heads), chosen.view(self.num_heads, B, N).permute(1, 2, 0)


# The router's matmul is no shape BLAS libraries tune: x [T, C] times a handful of rows. On an AMD Zen 3, MKL's
# SGEMM took 2-4x the time of the kernels' own loops at the study's and DiT-B's sizes (10-14 rows), half of the
# routing's cost; where it is faster (other CPUs, other shapes) the probe keeps it.
_LOGITS_PROBE = ImplProbe(disk_dir=default_disk_dir())
_LOGITS_PATHS: dict[tuple, str] = {}  # (shape, threads, op) -> the probe's choice, for this process


def router_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, C] @ weight^T ([R, C], a router's few rows) -> [T, R]: ``F.linear``, or without gradients or autocast
    on a CPU in float32 the kernels' ``moh_router_logits`` where it was faster for this shape on this machine
    (timed once per shape, thread count and build; ``visattn.attention.impl_probe``)."""
    # the device first: asking for the op loads (on first use builds) the CPU kernels
    op = moh_router_logits_op() if _logits_kernel_runs(x, weight) else None
    if op is not None and _logits_path(x, weight.shape[0], lambda: weight):
        return op(x, weight)
    return F.linear(x, weight)


def router_gates(
    x: torch.Tensor, weights: list[torch.Tensor], budget: tuple, tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Token choice's gates [T, H], keep [E, T] and head load ([T / tokens, H], empty for ``tokens`` 0) straight
    from the tokens x [T, C] and the linear routers' ``weights`` (``HeadRouter.linear_weights``), in one kernel
    (``moh_router_gates``: the logits per block of tokens, never stored; the same bits as ``router_linear``'s
    kernel and ``moh_gates``), where ``router_linear`` would take its kernel for these logits (float32, no
    autocast, the probe's choice); else None. The caller checks ``eager_cpu_kernels`` and that nothing needs
    gradients or the load-balancing loss."""
    op = moh_router_gates_op()
    if (op is None or moh_router_logits_op() is None or not weights or x.dtype != torch.float32
            or any(w.dtype != torch.float32 for w in weights) or torch.is_autocast_enabled("cpu")):
        return None
    rows = sum(w.shape[0] for w in weights)
    if not _logits_path(x, rows, lambda: torch.cat(weights, 0)):
        return None
    return op(x, weights, *budget, tokens)


def _logits_kernel_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernels may compute x [T, C] @ weight^T: eager CPU float32 tensors, no autocast (under it the
    matmul runs in autocast's dtype, as F.linear's callers expect) and no gradients to record."""
    # eager_cpu_kernels first: it says no to an fx Proxy, whose dtype cannot be compared
    return (eager_cpu_kernels(x) and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu")
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _logits_path(x: torch.Tensor, rows: int, weight: Callable[[], torch.Tensor]) -> bool:
    """Whether the kernels' loops were faster than ``F.linear`` for x [T, C] times ``rows`` router rows on this
    machine (the probe's choice, timed once per shape, thread count and build; ``weight()`` gives the stacked
    weights [rows, C] for the timing)."""
    op = moh_router_logits_op()
    shape = (*x.shape, rows)
    threads = torch.get_num_threads()
    path = _LOGITS_PATHS.get((shape, threads, op))  # a dict lookup per call: ImplProbe.choose costs ~50 us
    if path is None:
        w = weight()
        device = device_name(x.device)
        key = ("router_logits", device, threads, torch.__version__, shape, build_id())
        runs = {"router_linear": lambda: F.linear(x, w), "router_kernel": lambda: op(x, w)}
        path = _LOGITS_PATHS[shape, threads, op] = _LOGITS_PROBE.choose(key, runs, "router_linear", shape, "float32",
                                                                        device).path
    return path == "router_kernel"


def rank_constants(pool: int, k: int, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``top_k_mask``'s constants for a pool of ``pool`` heads, ``k`` kept: the heads of each pair
    a < b (later heads first, then earlier: [2P]), the pairs' signed incidence [pool, P] (+1 at b,
    -1 at a) and ``k - i`` per head i [pool, 1]."""
    pairs = [(a, b) for b in range(pool) for a in range(b)]
    index = torch.tensor([b for _, b in pairs] + [a for a, _ in pairs], dtype=torch.long, device=device)
    weight = torch.zeros(pool, len(pairs), device=device)
    for n, (a, b) in enumerate(pairs):
        weight[a, n] = -1.0
        weight[b, n] = 1.0
    bias = (k - torch.arange(pool, dtype=torch.float32, device=device)).unsqueeze(1)
    return index, weight, bias


def top_k_mask(probs: torch.Tensor, pairs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """probs [E, T] -> 0/1 floats [E, T]: 1 for the k largest of each column, ties to the lower
    index (exactly k ones per column for finite probabilities); the constants come from
    ``rank_constants(E, k)``.

    A head's rank is the number of heads that beat it (a larger probability, or an equal one at a
    lower index): for head i, i - sum_{a<i} [p_i > p_a] + sum_{b>i} [p_b > p_i], one small
    matmul over the pairs' comparisons (0/1 and +-1 entries: exact at any matmul precision). At
    the study's sizes this costs a fifth of ``topk`` (a sort per token), and bool tensors
    (compares, casts) cost several times their float counterparts, so it stays in float.
    """
    p = probs.detach()
    count = weight.shape[1]
    ends = p.index_select(0, pairs).view(2, count, p.shape[1])
    later_wins = (ends[0] - ends[1]).sign_().clamp_(0, 1)  # [P, T]: 1 where p_b > p_a
    return torch.addmm(bias.to(p.dtype), weight.to(p.dtype), later_wins).clamp_(0, 1)
