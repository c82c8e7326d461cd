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

    ``.module`` is the averaged model (eval mode, no gradients) for evaluation and sampling. The
    update is one ``foreach`` lerp over the parameter lists (timm's ModelEmaV3), the same arithmetic as
    a ``lerp_`` per parameter.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"ema decay={decay} must be in [0, 1] (typical: 0.9999)")
        self.decay = decay
        self.module = copy.deepcopy(unwrap_model(model)).eval()
        self.module.requires_grad_(False)
        self._pairs: tuple[nn.Module, list[tuple[list[torch.Tensor], list[torch.Tensor]]],
                           list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def _lists(self, source: nn.Module):
        """(parameter lists per EMA dtype: (ema, source)), [(ema buffer, source buffer)] for ``source``."""
        if self._pairs is None or self._pairs[0] is not source:
            ema_params = dict(self.module.named_parameters())
            groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for name, param in source.named_parameters():
                ema, src = groups.setdefault(ema_params[name].dtype, ([], []))
                ema.append(ema_params[name])
                src.append(param)
            ema_buffers = dict(self.module.named_buffers())
            buffers = [(ema_buffers[name], buf) for name, buf in source.named_buffers()]
            self._pairs = (source, list(groups.values()), buffers)
        return self._pairs[1], self._pairs[2]

    @torch.no_grad()
    def update(self, model: nn.Module, apply: torch.Tensor | None = None) -> None:
        """One EMA step towards ``model``'s weights. ``apply`` (0-d bool on the device, from
        ``step.StepGate``): where False the EMA stays exactly as it is (its weight is 0), with no
        host read."""
        groups, buffers = self._lists(unwrap_model(model))
        for ema, src in groups:
            dtype = ema[0].dtype
            src = [s if s.dtype == dtype else s.to(dtype) for s in src]
            if apply is None:
                torch._foreach_lerp_(ema, src, 1.0 - self.decay)
            else:  # the weight as a scalar lerp would take it: 1 - decay rounded to the dtype, or 0
                weight = apply.to(dtype) * (1.0 - self.decay)
                torch._foreach_lerp_(ema, src, [weight] * len(ema))
        for ema_buf, buf in buffers:
            ema_buf.copy_(buf if apply is None else torch.where(apply, buf, ema_buf))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state_dict)
