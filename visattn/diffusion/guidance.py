"""Classifier-free guidance for a class-conditional model ``model(x, t, y)`` whose label
``model.num_classes`` is the null (unconditional) class.

Guided output = out(x | null) + scale * (out(x | y) - out(x | null)) on the guided channels; the
other channels keep the conditional prediction.

Which channels: by default those DiT's sampler guides. DiT's ``forward_with_cfg`` slices
``model_out[:, :3]`` "for exact reproducibility reasons" (its comment), i.e. the first 3 channels
of the model OUTPUT whatever they hold: for the 4-channel SD-VAE latents, 3 of the 4 epsilon
channels (the 4th epsilon channel and the learned-variance channels stay conditional); for a
1-channel model with a learned variance, the epsilon and the variance channel. ``guided_channels=3``
(the default) reproduces that exactly, so released DiT checkpoints give their published samples.
``guided_channels=None`` is the standard approach (DiT's commented-out alternative): every epsilon
channel guided, the variance channels conditional.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .gaussian import ModelFn

DIT_GUIDED_CHANNELS = 3  # the first 3 model-output channels, as DiT's forward_with_cfg


def conditional_fn(model: nn.Module, y: torch.Tensor) -> ModelFn:
    """(x_t, t) -> model(x_t, t, y) in fp32 (under autocast the model's output is bf16)."""
    return lambda x, t: model(x, t, y).float()


def check_guided_channels(guided_channels: int | None) -> None:
    """Raise ValueError unless ``guided_channels`` is None or a positive int."""
    if guided_channels is not None and (isinstance(guided_channels, bool) or not isinstance(guided_channels, int)
                                        or guided_channels < 1):
        raise ValueError(
            f"guided_channels={guided_channels!r} must be a positive int (3 = DiT's sampler) or None (guide "
            f"every epsilon channel)"
        )


def guided_fn(
    model: nn.Module, y: torch.Tensor, scale: float, guided_channels: int | None = DIT_GUIDED_CHANNELS
) -> ModelFn:
    """(x_t, t) -> guided output [B, C_out, H, W]; one forward of the doubled batch (y, then null).

    ``guided_channels``: guide the first that many channels of the model output (capped at its
    channel count, as a slice is); None: every epsilon channel (the input's channel count).
    """
    check_guided_channels(guided_channels)

    def fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        null = torch.full_like(y, model.num_classes)
        out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null])).float()
        cond, uncond = out.chunk(2)
        c = x.shape[1] if guided_channels is None else min(guided_channels, out.shape[1])
        guided = uncond[:, :c] + scale * (cond[:, :c] - uncond[:, :c])
        return torch.cat([guided, cond[:, c:]], dim=1)

    return fn


def sampling_fn(
    model: nn.Module, y: torch.Tensor, scale: float = 1.0, guided_channels: int | None = DIT_GUIDED_CHANNELS
) -> ModelFn:
    """The conditional model at scale 1 (one forward, no null pass), the guided one otherwise."""
    check_guided_channels(guided_channels)
    if scale == 1.0:
        return conditional_fn(model, y)
    return guided_fn(model, y, scale, guided_channels)
