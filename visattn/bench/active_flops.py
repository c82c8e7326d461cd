"""Active-head FLOPs: what a model would cost if only its active heads did their query-side work.

Executed FLOPs (``visattn.utils.flops.count_flops`` in eval mode) count the path the code runs, which
for several MoH settings is the dense path (every head computed, then weighted). Active-head FLOPs
are the budget a head-skipping kernel could reach: the dense forward's FLOPs minus, per attention
layer ``x: [B, N, C]`` with ``a`` of ``h`` heads active per token,

    (1 - a / h) * (q projection + scores + weighted values + output projection)
  = (1 - a / h) * (4 * B * N * C * D + 4 * B * N^2 * D),     D = h * head_dim (the heads' total width)

(2 FLOPs per multiply-accumulate, torch's convention). Keys and values are computed for every head
(any token may attend to them), and the router is counted as executed. For a model that activates
every head, active-head FLOPs equal the dense forward's FLOPs.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from visattn.attention.base import HeadAttention
from visattn.utils.flops import count_flops


def query_side_flops(batch: int, tokens: int, dim: int, attn_dim: int) -> int:
    """q projection + q k^T + attention x v + output projection of one layer with all heads."""
    return 4 * batch * tokens * dim * attn_dim + 4 * batch * tokens**2 * attn_dim


def active_head_flops(model: nn.Module, *inputs: torch.Tensor) -> float:
    """Active-head FLOPs of ``model(*inputs)`` (see the module docstring). The dense forward is
    counted in training mode under ``no_grad`` (where every head runs), with the RNG left untouched."""
    skipped: list[float] = []

    def hook(module: HeadAttention, args: tuple) -> None:
        active, total = module.active_heads
        if active < total:
            b, n, c = args[0].shape
            skipped.append((1 - active / total) * query_side_flops(b, n, c, module.attn_dim))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, HeadAttention)]
    was_training = model.training
    try:
        model.train()
        with torch.random.fork_rng(devices=[]):
            dense = count_flops(model, *inputs)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return float(dense - sum(skipped))
