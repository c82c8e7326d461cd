"""The decision after each backward pass, the same on every rank: apply the update or skip it
(non-finite loss / gradient norm, see ``guard``), and whether to stop for preemption."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn

from .distributed import all_reduce_sum
from .guard import NonFiniteGuard
from .preempt import StopSignal


def clip_and_norm(parameters: Iterable[torch.Tensor], clip: float | None) -> torch.Tensor:
    """The total gradient norm (before clipping); clips to ``clip`` when it is set (``train.clip_grad``)."""
    return nn.utils.clip_grad_norm_(list(parameters), clip if clip else math.inf)


class StepGate:
    """``decide(step, loss, grad_norm) -> (apply_update, stop_now)``, agreed over ranks with one
    all-reduce: a NaN anywhere makes the summed loss NaN on every rank, and one rank's stop signal
    stops them all at the same step."""

    def __init__(self, guard: NonFiniteGuard, stop: StopSignal, device: torch.device) -> None:
        self.guard, self.stop, self.device = guard, stop, device

    def decide(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[bool, bool]:
        flags = torch.stack([loss.detach().to(torch.float64), grad_norm.detach().to(torch.float64),
                             torch.tensor(float(self.stop.requested), dtype=torch.float64, device=loss.device)])
        loss_sum, norm_sum, stops = all_reduce_sum(flags.to(self.device)).tolist()
        return self.guard.check(step, loss_sum, norm_sum), stops > 0
