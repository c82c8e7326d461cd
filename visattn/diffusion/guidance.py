"""Classifier-free guidance for a class-conditional model ``model(x, t, y)`` whose label
``model.num_classes`` is the null (unconditional) class.

Guided epsilon = eps(x | null) + scale * (eps(x | y) - eps(x | null)).
By default every input channel of the epsilon prediction is guided. The original DiT sampler
guided only the first 3 of the 4 latent channels (a quirk of its code); ``guided_channels=3``
reproduces it (the remaining channels keep the conditional prediction). The learned-variance
channels always come from the conditional pass.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .gaussian import ModelFn


def conditional_fn(model: nn.Module, y: torch.Tensor) -> ModelFn:
    """(x_t, t) -> model(x_t, t, y)."""
    return lambda x, t: model(x, t, y)


def guided_fn(model: nn.Module, y: torch.Tensor, scale: float, guided_channels: int | None = None) -> ModelFn:
    """(x_t, t) -> guided output [B, C_out, H, W]; one forward of the doubled batch (y, then null)."""

    def fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        null = torch.full_like(y, model.num_classes)
        out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null])).float()
        cond, uncond = out.chunk(2)
        c = x.shape[1] if guided_channels is None else guided_channels
        if not 1 <= c <= x.shape[1]:
            raise ValueError(f"guided_channels={guided_channels} must be in [1, {x.shape[1]}]")
        eps = uncond[:, :c] + scale * (cond[:, :c] - uncond[:, :c])
        return torch.cat([eps, cond[:, c:]], dim=1)

    return fn


def sampling_fn(model: nn.Module, y: torch.Tensor, scale: float = 1.0, guided_channels: int | None = None) -> ModelFn:
    """The conditional model at scale 1 (one forward, no null pass), the guided one otherwise."""
    if scale == 1.0:
        return conditional_fn(model, y)
    return guided_fn(model, y, scale, guided_channels)
