"""A module with its inputs, and the two calls the harness times: inference and one training step."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from visattn import kernels
from visattn.attention import aux_loss
from visattn.attention.moh import MoHAttention

DTYPES = {"fp32": None, "bf16": torch.bfloat16}
AUX_WEIGHT = 0.01  # MoH's beta; the training step includes the load-balancing loss like a real one


def autocast_for(dtype_name: str, device_type: str = "cpu"):
    """float32: no autocast; bf16: autocast on ``device_type`` (the mixed-precision path a user runs)."""
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype {dtype_name!r} is not known; use one of {sorted(DTYPES)}")
    dtype = DTYPES[dtype_name]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type, dtype=dtype)


@contextlib.contextmanager
def moh_impl(module: nn.Module, impl: str | None):
    """Within the block, every MoH layer of ``module`` runs with ``impl`` (None: as built)."""
    layers = [m for m in module.modules() if isinstance(m, MoHAttention)] if impl is not None else []
    before = [m.impl for m in layers]
    for m in layers:
        m.impl = impl
    try:
        yield
    finally:
        for m, old in zip(layers, before, strict=True):
            m.impl = old


@dataclass
class Workload:
    """``module(*inputs)`` -> a tensor (or a tuple whose first item is the output).
    ``infer_impl``: the MoH ``impl`` inference runs with (None: the module's own; training always
    runs with the module's own). ``optimizer``: stepped at the end of each training step (None: the
    step is forward and backward only)."""

    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    infer_impl: str | None = None
    optimizer: torch.optim.Optimizer | None = None
    compiled: nn.Module | None = None  # torch.compile(module): what forward calls when set
    use_kernels: bool = True  # False: the PyTorch code instead of visattn.kernels (A/B rows)

    def compile(self) -> Workload:
        """Forward through ``torch.compile(module)`` (inductor) from now on."""
        self.compiled = torch.compile(self.module)
        return self

    @contextlib.contextmanager
    def eager(self):
        """Forward through the module itself within the block (FLOP counting sees every operation)."""
        compiled, self.compiled = self.compiled, None
        try:
            yield self
        finally:
            self.compiled = compiled

    @property
    def device(self) -> torch.device:
        return self.inputs[0].device

    def to(self, device: torch.device) -> Workload:
        """The module and inputs on ``device`` (in place; before the optimizer's first step, whose
        state is created where the parameters are)."""
        self.module.to(device)
        self.inputs = tuple(x.to(device) for x in self.inputs)
        return self

    def forward(self) -> torch.Tensor:
        with contextlib.nullcontext() if self.use_kernels else kernels.disabled():
            out = (self.module if self.compiled is None else self.compiled)(*self.inputs)
        return out[0] if isinstance(out, tuple) else out

    def infer(self) -> torch.Tensor:
        with moh_impl(self.module, self.infer_impl):
            return self.forward()

    def loss(self) -> torch.Tensor:
        loss = self.forward().float().square().mean()
        return loss + AUX_WEIGHT * aux_loss(self.module)

    def train_step(self, dtype_name: str) -> None:
        """Forward and backward, and the optimizer's update where the workload has one."""
        for p in self.module.parameters():
            p.grad = None
        with autocast_for(dtype_name, self.device.type):
            loss = self.loss()
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
