"""Exponential moving average of a model's weights (kept in float32 on the model's device)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
import torch.nn as nn


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module under DDP (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


class ModelEMA:
    """``ema = decay * ema + (1 - decay) * weights`` after each ``update``; buffers are copied.

    ``.module`` is the averaged model (eval mode, no gradients) for evaluation and sampling.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"ema decay={decay} must be in [0, 1] (typical: 0.9999)")
        self.decay = decay
        self.module = copy.deepcopy(unwrap_model(model)).eval()
        self.module.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        source = unwrap_model(model)
        ema_params = dict(self.module.named_parameters())
        for name, param in source.named_parameters():
            ema_params[name].lerp_(param.detach().to(ema_params[name].dtype), 1.0 - self.decay)
        ema_buffers = dict(self.module.named_buffers())
        for name, buf in source.named_buffers():
            ema_buffers[name].copy_(buf)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state_dict)
