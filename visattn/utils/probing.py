"""Run a model for a measurement without leaving a trace on it (FLOP counts, start-up probes)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn


@contextlib.contextmanager
def untouched(model: nn.Module, training: bool = True) -> Iterator[nn.Module]:
    """Within the block ``model`` is in training (or eval) mode and torch's CPU random state is forked;
    on exit its mode and buffers (e.g. batch-norm running statistics) are as before."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    was_training = model.training
    try:
        model.train(training)
        with torch.random.fork_rng(devices=[]):
            yield model
    finally:
        model.train(was_training)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])
