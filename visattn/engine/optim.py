"""AdamW with decay only where it belongs, and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn
from timm.optim import param_groups_weight_decay

SCHEDULES = ("cosine", "constant")


def no_decay_patterns(model: nn.Module, patterns: Iterable[str] = ()) -> set[str]:
    """fnmatch patterns of parameters without weight decay: ``patterns`` plus the model's own
    ``no_weight_decay()`` names (timm convention: position embeddings, tokens)."""
    names = set(patterns)
    if hasattr(model, "no_weight_decay"):
        names |= set(model.no_weight_decay())
    return names


def adamw_kind(device: torch.device | str) -> dict[str, bool]:
    """``fused=True`` where torch has a fused AdamW for ``device`` (CUDA and CPU among them): one
    kernel per step, and the ``found_inf`` argument with which ``step.optimizer_step`` skips an update
    on the device. ``foreach=True`` on other devices with foreach kernels; else torch's default."""
    from torch.utils._foreach_utils import (
        _get_foreach_kernels_supported_devices,
        _get_fused_kernels_supported_devices,
    )

    kind = torch.device(device).type
    if kind in _get_fused_kernels_supported_devices():
        return {"fused": True}
    return {"foreach": True} if kind in _get_foreach_kernels_supported_devices() else {}


def adamw(params: Iterable[Any], device: torch.device | str, **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)`` in the implementation ``adamw_kind`` picks for ``device``."""
    return torch.optim.AdamW(params, **kwargs, **adamw_kind(device))


def build_optimizer(model: nn.Module, optim: Mapping[str, Any],
                    device: torch.device | str | None = None) -> torch.optim.Optimizer:
    """AdamW (see ``adamw``; ``device``: the model's, by default where its first parameter is); 1-d
    parameters (norms, biases) and names matching ``optim.no_decay`` get no decay."""
    if optim.get("name", "adamw") != "adamw":
        raise ValueError(f"optim.name={optim['name']!r} is not supported; use optim=adamw")
    groups = param_groups_weight_decay(
        model, weight_decay=optim["weight_decay"], no_weight_decay_list=no_decay_patterns(model, optim.get("no_decay", ()))
    )
    if device is None:
        device = next(model.parameters()).device
    return adamw(groups, device, lr=optim["lr"], betas=tuple(optim["betas"]), eps=optim["eps"])


class WarmupSchedule:
    """Learning rate per optimizer update: linear warm-up from ``warmup_lr`` to ``base_lr`` over
    ``warmup_steps``, then cosine decay to ``min_lr`` at ``total_steps`` (or constant)."""

    def __init__(self, base_lr: float, total_steps: int, warmup_steps: int = 0, warmup_lr: float = 1e-6,
                 min_lr: float = 0.0, kind: str = "cosine") -> None:
        if kind not in SCHEDULES:
            raise ValueError(f"sched.name={kind!r} is not known; use one of {SCHEDULES}")
        self.base_lr, self.total_steps, self.warmup_steps = base_lr, total_steps, warmup_steps
        self.warmup_lr, self.min_lr, self.kind = warmup_lr, min_lr, kind

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.warmup_lr + (self.base_lr - self.warmup_lr) * step / self.warmup_steps
        if self.kind == "constant":
            return self.base_lr
        span = max(1, self.total_steps - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + 0.5 * (self.base_lr - self.min_lr) * (1.0 + math.cos(math.pi * t))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
