"""FLOP counting with ``torch.utils.flop_counter``, including the CPU attention kernel.

torch's counter has formulas for the CUDA SDPA kernels only, so on CPU the fused attention
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) counts 0 FLOPs. The formulas
here are passed per counting session (``custom_mapping``), so torch's global registry stays untouched.
Convention: torch's, 2 FLOPs per multiply-accumulate; attention forward is ``4 * B * H * N * M * d``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def sdpa_flop_formulas() -> dict[Any, Callable[..., int]]:
    """FLOP formulas for the SDPA kernels torch does not count (those that run on CPU)."""
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flop,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flop,
    }


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` that also counts the CPU SDPA kernels."""
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
