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

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_function

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
    """probs [B, N, E] -> bool [B, N, E]: True for the ``head_capacity`` tokens of each image with the
    highest probability for each routed head."""
    capacity = head_capacity(probs.shape[1], routed_topk, pool)
    _, top = probs.topk(capacity, dim=1)  # [B, c, E]
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(1, top, True)


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

    def _shared_gates(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, shared_heads]: softmax(W_s x) * hs, or 1 for a single shared head."""
        shared = self.shared
        if shared is None:
            return x.new_ones((x.shape[0], x.shape[1], self.shared_heads))
        soft = F.softmax(shared(x).float(), dim=-1) * self.shared_heads
        if self.gate_mode == "binary_ste":
            return 1.0 + (soft - soft.detach())  # exactly 1 forward
        return soft

    def _routed_gates(self, x: torch.Tensor, q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed pool gates [B, N, E] and the boolean selection [B, N, E]."""
        routed = self.routed
        if routed is not None:  # the linear router
            scores = routed(x).float()
        else:
            if q is None:
                raise ValueError("router='l2norm' needs the queries: call forward(x, q)")
            scores = torch.linalg.vector_norm(q[:, self.shared_heads :].float(), dim=-1).transpose(1, 2)  # [B, N, E]
        probs = F.softmax(scores, dim=-1)
        if self.routing == "head_choice":
            return self._head_choice(probs)
        _, top = probs.topk(self.routed_topk, dim=-1)
        selected = torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, top, True)
        if self.training and routed is not None:
            # Released code's scale: E * sum_i f_i P_i over all B*N tokens (beta = 0.01 tuned for it).
            f = selected.float().mean(dim=(0, 1))
            p = probs.mean(dim=(0, 1))
            self.aux_loss = (f * p).sum() * self.pool
        if self.gate_mode == "binary_ste":
            return self._binary(probs, selected), selected
        kept = probs * selected
        denom = kept.sum(dim=-1, keepdim=True).clamp_min(self.eps)
        return kept / denom * self.routed_topk, selected

    def _head_choice(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """probs [B, N, E] -> gates and selection [B, N, E]: each routed head keeps the
        ``head_capacity`` tokens of each image with the highest probability for it."""
        selected = head_choice_selection(probs, self.routed_topk, self.pool)
        if self.gate_mode == "binary_ste":
            return self._binary(probs, selected), selected
        return probs * selected * self.pool, selected

    def _binary(self, probs: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """Exactly 0/1 gates forward, straight-through gradients to ``probs`` backward."""
        return selected.to(probs.dtype) + (probs - probs.detach())

    def forward(self, x: torch.Tensor, q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, N, C], q: [B, H, N, d] (only the l2norm router reads it).

        Returns gates [B, N, H] (float32; zero where a head is off) and the boolean selection
        [B, N, H] (True for shared heads and the chosen routed heads).
        """
        B, N, _ = x.shape
        if self.routed_topk == 0:  # dense: soft weights over every head
            gates = self._shared_gates(x)
            selected = x.new_ones((B, N, self.num_heads), dtype=torch.bool)
        else:
            routed, selected = self._routed_gates(x, q)
            if self.shared_heads == 0:
                gates = routed
            else:
                shared = self._shared_gates(x).to(routed.dtype)
                mix = self.mix
                if mix is not None:
                    alpha = F.softmax(mix(x).float(), dim=-1) * 2
                    shared = shared * alpha[..., :1]
                    routed = routed * alpha[..., 1:]
                gates = torch.cat([shared, routed], dim=-1)
            always = x.new_ones((B, N, self.shared_heads), dtype=torch.bool)
            selected = torch.cat([always, selected], dim=-1)
        self.head_load = selected.float().mean(dim=1) if keeps_stats() else None
        return gates, selected
