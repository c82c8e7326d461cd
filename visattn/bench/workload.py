"""A module with its inputs, and the two calls the harness times: inference and one training step."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from visattn.attention import aux_loss

DTYPES = {"fp32": None, "bf16": torch.bfloat16}
AUX_WEIGHT = 0.01  # MoH's beta; the training step includes the load-balancing loss like a real one


def autocast_for(dtype_name: str):
    """float32: no autocast; bf16: CPU autocast (the mixed-precision path a user runs)."""
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype {dtype_name!r} is not known; use one of {sorted(DTYPES)}")
    dtype = DTYPES[dtype_name]
    return contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)


@dataclass
class Workload:
    """``module(*inputs)`` -> a tensor (or a tuple whose first item is the output)."""

    module: nn.Module
    inputs: tuple[torch.Tensor, ...]

    def forward(self) -> torch.Tensor:
        out = self.module(*self.inputs)
        return out[0] if isinstance(out, tuple) else out

    def infer(self) -> torch.Tensor:
        return self.forward()

    def loss(self) -> torch.Tensor:
        loss = self.forward().float().square().mean()
        return loss + AUX_WEIGHT * aux_loss(self.module)

    def train_step(self, dtype_name: str) -> None:
        """Forward and backward (the optimiser update is the same for every variant and left out)."""
        for p in self.module.parameters():
            p.grad = None
        with autocast_for(dtype_name):
            loss = self.loss()
        loss.backward()
