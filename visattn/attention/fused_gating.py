"""MoH's routing and head gating on the compiled kernels with gradients (``visattn/kernels/moh_routing.cpp``).

In training, the PyTorch routing is about 25 small operations forward and as many backward, and the
gated head merge a repeat, a product and a reduction each way. At the study's sizes they cost a
third of a MoH layer's training step over MHA's (docs/benchmarks.md). Here each is one kernel call
forward and one backward, wrapped in an autograd Function. Where the kernels do not run
(``eager_cpu_kernels``), callers run the PyTorch code, and the tests hold the two equal.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from visattn.kernels import has_sgemm, moh_routing_op


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (grad, vmap, ...) is running: the kernels' autograd Functions
    have no batching rule or functorch ``setup_context``, so the PyTorch code runs instead."""
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def needs_grad(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether autograd would record a forward of ``module`` on x (x or a parameter requires grad)."""
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))


def eager_cpu(x: torch.Tensor) -> bool:
    """Whether a compiled CPU kernel may replace PyTorch code for x: an eager CPU tensor, outside
    ``torch.compile`` / fx tracing (they trace the PyTorch code), ``torch.func`` transforms and Python
    dispatch modes (e.g. the FLOP counter, which should see the operations). The caller checks that its
    kernel is built and switched on."""
    return (
        type(x) is torch.Tensor  # first: an fx Proxy's attributes cannot be tested
        and x.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and _get_current_dispatch_mode() is None
        and not functorch_active()
    )


def eager_cpu_kernels(x: torch.Tensor) -> bool:
    """``eager_cpu`` with MoH's routing kernels built and switched on. Their backward is once-differentiable:
    double backward (``create_graph=True``) needs ``visattn.kernels.disabled()``."""
    return eager_cpu(x) and moh_routing_op() is not None


def eager_cuda_gates(x: torch.Tensor) -> bool:
    """Whether the Triton gates (``visattn.kernels.moh_cuda_gates_op``, where Triton is installed) may replace
    the PyTorch routing for x: an eager CUDA tensor, outside ``torch.compile``, fx tracing, ``torch.func``
    and Python dispatch modes (with gradients through ``RoutedGatesCuda``)."""
    return (
        type(x) is torch.Tensor
        and x.device.type == "cuda"
        and not torch.compiler.is_compiling()
        and _get_current_dispatch_mode() is None
        and not functorch_active()
    )


class RoutedGates(torch.autograd.Function):
    """``torch.ops.visattn.moh_gates`` with its backward.

    forward(logits [R, T] float32, budget (S, E, k, two_stage, shared_routed, eps), with_aux) ->
    (gates [T, S + E], keep [E, T] (not differentiable), load-balancing loss (0 without ``with_aux``)).
    The loss is the released code's ``E * sum_e f_e * P_e`` (``HeadRouter.forward``): f_e the share of
    tokens that chose head e (a constant), P_e its mean probability.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, budget: tuple, with_aux: bool):
        gates, keep, load, aux = moh_routing_op()(logits, *budget, with_aux)
        ctx.save_for_backward(logits, keep, load)
        ctx.budget, ctx.with_aux = budget, with_aux
        ctx.mark_non_differentiable(keep)
        return gates, keep, aux

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_gates, _grad_keep, grad_aux):
        logits, keep, load = ctx.saved_tensors
        S, E, k, two_stage, shared_routed, eps = ctx.budget
        if grad_gates is None:
            grad_gates = logits.new_zeros((logits.shape[1], S + E))
        # d aux / d P[e, t] = E * f_e / T for every token
        aux_grad = load * (grad_aux * E / logits.shape[1]) if ctx.with_aux and grad_aux is not None else logits.new_empty(0)
        grad = torch.ops.visattn.moh_gates_backward(logits, keep, grad_gates, aux_grad, S, E, k, two_stage,
                                                    shared_routed, eps)
        return grad, None, None


class RoutedGatesCuda(torch.autograd.Function):
    """The Triton gates on a GPU (``gates_op``: ``visattn.kernels.moh_cuda_gates_op()``) with their backward
    (``cuda_routing.moh_gates_backward_cuda``): ``RoutedGates`` for CUDA tensors, for training.

    forward(logits [R, T] (any float dtype and strides), gates_op, budget (S, E, k, two_stage, shared_routed,
    eps), tokens (per image), with_aux) -> (gates [T, S + E] float32, keep [E, T] and each image's head load
    [B, S + E] (neither differentiable), the load-balancing loss as ``RoutedGates`` gives it (0 without
    ``with_aux``)).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, gates_op, budget: tuple, tokens: int, with_aux: bool):
        gates, keep, load, prob_sums = gates_op(logits, *budget, tokens, prob_sums=True)
        S, E = budget[0], budget[1]
        T = logits.shape[1]
        share = load[:, S:].mean(0)  # f_e: every image has `tokens` tokens, so the mean of the images' shares
        aux = (share * prob_sums.sum(0)).sum() * (E / T) if with_aux else gates.new_zeros(())
        ctx.save_for_backward(logits, keep, share)
        ctx.budget, ctx.with_aux = budget, with_aux
        ctx.mark_non_differentiable(keep, load)
        return gates, keep, load, aux

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_gates, _grad_keep, _grad_load, grad_aux):
        from visattn.kernels.cuda_routing import moh_gates_backward_cuda

        logits, keep, share = ctx.saved_tensors
        S, E = ctx.budget[0], ctx.budget[1]
        T = logits.shape[1]
        if grad_gates is None:
            grad_gates = keep.new_zeros((T, S + E))
        # d aux / d P[e, t] = E * f_e / T for every token
        aux_grad = share * (grad_aux * E / T) if ctx.with_aux and grad_aux is not None else None
        grad = moh_gates_backward_cuda(logits, keep, grad_gates, aux_grad, *ctx.budget)
        return grad, None, None, None, None


def routed_gates(logits: torch.Tensor, budget: tuple, with_aux: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``RoutedGates.apply`` where autograd needs it (the load-balancing loss, or gradients to the
    logits), else the op alone: the Function's bookkeeping cost about 10 us a layer for nothing."""
    if with_aux or (torch.is_grad_enabled() and logits.requires_grad):
        return RoutedGates.apply(logits, budget, with_aux)
    gates, keep, _, aux = moh_routing_op()(logits, *budget, False)
    return gates, keep, aux


class GatedMerge(torch.autograd.Function):
    """``torch.ops.visattn.moh_gated_merge`` with its backward: heads [B, H, N, d] float32 (laid out as
    [B, N, H, d]) weighted by gates [B, N, H] float32 -> [B, N, H * d]."""

    @staticmethod
    def forward(ctx, heads: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(heads, gates)  # heads: attention's output, which its backward keeps anyway
        return torch.ops.visattn.moh_gated_merge(heads, gates)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        heads, gates = ctx.saved_tensors
        return tuple(torch.ops.visattn.moh_gated_merge_backward(grad_out, heads, gates))


def gated_merge_runs(heads: torch.Tensor, gates: torch.Tensor) -> bool:
    """Whether ``GatedMerge`` serves these tensors: float32 on the CPU, heads [B, H, N, d] laid out as
    [B, N, H, d] (SDPA's output; the merge then reads each token's heads as one row)."""
    return (
        eager_cpu_kernels(heads) and type(gates) is torch.Tensor
        and heads.dtype == torch.float32 and gates.dtype == torch.float32 and heads.transpose(1, 2).is_contiguous()
    )


class GatedProjection(torch.autograd.Function):
    """``torch.ops.visattn.moh_gated_proj`` with its backward: the gated merge of heads [B, H, N, d] float32
    (laid out as [B, N, H, d]) by gates [B, N, H] and the output projection (weight [dim_out, H * d], bias
    [dim_out] or None) in one pass over blocks of tokens -> [B, N, dim_out]. The merged heads never go to
    memory whole, either way; at the study's sizes the separate merge cost as much as the projection."""

    @staticmethod
    def forward(ctx, heads: torch.Tensor, gates: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        ctx.save_for_backward(heads, gates, weight)
        ctx.has_bias = bias is not None
        return torch.ops.visattn.moh_gated_proj(heads, gates, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        heads, gates, weight = ctx.saved_tensors
        grad_heads, grad_gates, grad_weight, grad_bias = torch.ops.visattn.moh_gated_proj_backward(
            grad_out, heads, gates, weight, ctx.has_bias
        )
        return grad_heads, grad_gates, grad_weight, grad_bias if ctx.has_bias else None


def gated_projection(
    heads: torch.Tensor, gates: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``GatedProjection.apply`` where autograd records it, else the op alone (as ``routed_gates``: the Function's
    bookkeeping for nothing in inference)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (heads, gates, weight, bias)):
        return GatedProjection.apply(heads, gates, weight, bias)
    return torch.ops.visattn.moh_gated_proj(heads, gates, weight, bias)


def gated_projection_runs(
    heads: torch.Tensor, gates: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    """Whether ``GatedProjection`` serves these tensors: ``gated_merge_runs``, a float32 contiguous weight
    and bias, SGEMM in this torch build, and no autocast (which would run the projection in another dtype)."""
    return (
        gated_merge_runs(heads, gates) and weight.dtype == torch.float32 and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        and not torch.is_autocast_enabled("cpu") and has_sgemm()
    )
