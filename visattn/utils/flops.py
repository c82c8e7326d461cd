"""FLOP counting with ``torch.utils.flop_counter``, including the CPU attention kernel.

torch's counter has formulas for the CUDA SDPA kernels only, so on CPU the fused attention
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) counts 0 FLOPs, and older
torch releases reject grouped key/value heads (MQA/GQA) in those formulas. The formulas here cover
every fused SDPA kernel and are passed per counting session (``custom_mapping``), so torch's global
registry stays untouched.
Convention: torch's, 2 FLOPs per multiply-accumulate; attention forward is ``4 * B * H * N * M * d``.

Active-head FLOPs (``active_head_flops``) are what a model would cost if only its active heads did
their query-side work. Executed FLOPs (``count_flops`` in eval mode) count the path the code runs,
which for several MoH settings is the dense path (every head computed, then weighted). Active-head
FLOPs are the budget a head-skipping kernel could reach: the dense forward's FLOPs minus, per
attention layer ``x: [B, N, C]`` with ``a`` of ``h`` heads active per token,

    (1 - a / h) * (q projection + scores + weighted values + output projection)
  = (1 - a / h) * (4 * B * N * C * D + 4 * B * N^2 * D),     D = h * head_dim (the heads' total width)

Keys and values are computed for every head (any token may attend to them), and the router is
counted as executed. For a model that activates every head, active-head FLOPs equal the dense
forward's FLOPs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from .probing import untouched

aten = torch.ops.aten


def _query_heads(query_shape, shape) -> tuple[int, ...]:
    """``shape`` ([B, H_kv, M, d]) widened to the query's heads: under ``enable_gqa`` each key/value
    head serves H_q / H_kv query heads and scores are computed per query head. torch 2.11's
    ``sdpa_flop_count`` rejects H_kv < H_q (2.14 accepts it), so the formulas pass it these shapes."""
    b, _, m, d = shape
    return (b, query_shape[1], m, d)


def _sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, _query_heads(query_shape, key_shape), _query_heads(query_shape, value_shape))


def _sdpa_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(
        grad_out_shape, query_shape, _query_heads(query_shape, key_shape), _query_heads(query_shape, value_shape)
    )


def sdpa_flop_formulas() -> dict[Any, Callable[..., int]]:
    """FLOP formulas for every fused SDPA kernel, forward and backward (see the module docstring)."""
    forward = ["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"]
    formulas: dict[Any, Callable[..., int]] = {}
    for name in forward:
        for op, formula in ((name, _sdpa_flop), (f"{name}_backward", _sdpa_backward_flop)):
            if hasattr(aten, op):  # the cuDNN kernel is missing from older torch builds
                formulas[getattr(aten, op)] = formula
    return formulas


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts the CPU SDPA kernel and grouped key/value heads."""
    return FlopCounterMode(display=False, custom_mapping=sdpa_flop_formulas())


def count_flops(model_or_fn: nn.Module | Callable[..., Any], *inputs: Any, **kwargs: Any) -> int:
    """FLOPs of one call ``model_or_fn(*inputs, **kwargs)``.

    A module is called under ``torch.no_grad`` in its current mode (so an eval-mode MoH layer counts
    its sparse inference path); any other callable is called as is, so it may run a backward pass
    (e.g. a whole training step) and have it counted too.
    """
    with flop_counter() as counter:
        if isinstance(model_or_fn, nn.Module):
            with torch.no_grad():
                model_or_fn(*inputs, **kwargs)
        else:
            model_or_fn(*inputs, **kwargs)
    return int(counter.get_total_flops())


def query_side_flops(batch: int, tokens: int, dim: int, attn_dim: int) -> int:
    """q projection + q k^T + attention x v + output projection of one layer with all heads."""
    return 4 * batch * tokens * dim * attn_dim + 4 * batch * tokens**2 * attn_dim


def _is_head_layer(module: nn.Module) -> bool:
    """An attention layer that reports its active heads: ``active_heads -> (active, total)`` and
    ``attn_dim`` (``visattn.attention.base.HeadAttention``; matched by attribute, so this module
    stays below ``visattn.attention``)."""
    return hasattr(module, "attn_dim") and isinstance(getattr(module, "active_heads", None), tuple)


def active_head_flops(model: nn.Module, *inputs: torch.Tensor) -> float:
    """Active-head FLOPs of ``model(*inputs)`` (see the module docstring). The dense forward is
    counted in training mode under ``no_grad`` (where every head runs), with the RNG and the buffers
    (e.g. batch-norm running statistics) left untouched. Each head layer's first input is ``x: [B, N, C]``."""
    skipped: list[float] = []

    def hook(module: nn.Module, args: tuple) -> None:
        active, total = module.active_heads
        if active < total:
            b, n, c = args[0].shape
            skipped.append((1 - active / total) * query_side_flops(b, n, c, module.attn_dim))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if _is_head_layer(m)]
    try:
        with untouched(model, training=True):
            dense = count_flops(model, *inputs)
    finally:
        for handle in handles:
            handle.remove()
    return float(dense - sum(skipped))
