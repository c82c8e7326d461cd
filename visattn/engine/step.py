"""The decision after each backward pass, taken on the device so that the training step never waits
for it: apply the update or skip it (non-finite loss / gradients, see ``guard``), and whether to stop
for preemption.

``StepGate.check`` returns a 0-d bool tensor on the device; ``optimizer_step`` and ``ModelEMA.update``
take it and leave weights, optimizer state and EMA exactly as they were where it is False (the fused
AdamW's ``found_inf``, as ``torch.amp.GradScaler`` uses it; a zero EMA weight). The guard's counters
stay on the device, and the host reads them in ``StepGate.sync``, called by the loops at their log
and save points only: a run past ``train.max_nonfinite_steps`` stops there with ``NonFiniteError``
(the same error and failure record as when it was checked every step: the counters freeze at the
step that passed the limit, and no update is applied after it), before any checkpoint is written.

The stop signal: in one process ``stop_now`` reads the handler's Python flag (free). Under DDP the
ranks agree with the one all-reduce the check does anyway; on CPU (gloo, synchronous) its result is
read at once, on CUDA one step later from a pinned copy (an event of the previous step, which the
device has long passed; the queue of the current step is not drained), so all ranks stop at the same
step, one step after the signal.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as tdist
import torch.nn as nn

from .distributed import all_reduce_sum
from .guard import NonFiniteGuard
from .preempt import StopSignal


def clip_and_norm(parameters: Iterable[torch.Tensor], clip: float | None) -> torch.Tensor:
    """With ``clip`` (``train.clip_grad``): the total gradient norm before clipping, the gradients
    clipped to ``clip``. Without: no norm is computed, only whether every gradient is finite (one
    pass, nothing rescaled): 0 when they all are, inf otherwise. Called once per step."""
    params = [p for p in parameters if p.grad is not None]
    if clip:
        return nn.utils.clip_grad_norm_(params, clip)
    return nonfinite_grads([p.grad for p in params])


def nonfinite_grads(grads: list[torch.Tensor]) -> torch.Tensor:
    """0-d float32 on the gradients' device: 0 when every gradient is finite, inf otherwise (the
    check ``GradScaler`` runs, at scale 1: the gradients are left as they are)."""
    if not grads:
        return torch.zeros(())
    found = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones_like(found))
    return torch.where(found > 0, math.inf, 0.0)


def optimizer_step(optimizer: torch.optim.Optimizer, apply: torch.Tensor) -> None:
    """``optimizer.step()`` where ``apply`` (0-d bool on the device) holds; where it does not, weights
    and optimizer state stay exactly as they were. Optimizers with ``found_inf`` support (fused
    AdamW) decide on the device; any other optimizer makes the host read ``apply`` (one sync)."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = (~apply).to(torch.float32)
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif bool(apply):
        optimizer.step()


class _HostCopy:
    """A 0-d device value copied to the host without waiting: ``push`` enqueues the copy (pinned
    memory and an event on CUDA), ``read`` waits for that event only, then reads the copy."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.zeros((), dtype=torch.float64, pin_memory=self.cuda)
        self.view = self.host.numpy()  # read through numpy: a plain memory read, no tensor call
        self.event = torch.cuda.Event() if self.cuda else None
        self.pending = False

    def push(self, value: torch.Tensor) -> None:
        self.host.copy_(value, non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()
        self.pending = True

    def read(self) -> float:
        if self.event is not None:
            self.event.synchronize()
        self.pending = False
        return float(self.view)


# the device state of the guard: counters, and the last non-finite step's numbers
_CONSECUTIVE, _SKIPPED, _TRIPPED, _LAST_STEP, _LAST_WHAT, _LAST_VALUE = range(6)
_LOSS, _GRAD = 1.0, 2.0  # _LAST_WHAT codes


class StepGate:
    """``check(step, loss, grad) -> apply`` (0-d bool on the device) once per step, after
    ``clip_and_norm``; ``stop_now()`` after it; ``sync(step)`` at log and save points.

    ``grad`` is ``clip_and_norm``'s value (a norm with clipping, else 0 / inf). Under DDP the loss,
    ``grad`` and the stop flag are summed over ranks in one all-reduce (a NaN anywhere makes every
    rank's sum NaN), so every rank applies or skips alike and stops at the same step.
    ``grad_what``: how the guard names ``grad`` in its messages."""

    def __init__(self, guard: NonFiniteGuard, stop: StopSignal, device: torch.device, *,
                 grad_what: str = "gradient norm", distributed: bool | None = None, lag: bool | None = None) -> None:
        self.guard, self.stop, self.device, self.grad_what = guard, stop, torch.device(device), grad_what
        self.distributed = tdist.is_initialized() if distributed is None else distributed
        # CUDA under DDP: the agreed stop flag is read one step late (see the module docstring)
        self.lag = (self.device.type == "cuda" and self.distributed) if lag is None else lag
        self._state: torch.Tensor | None = None  # made at the first check, from the guard's counts
        self._stop_flags = [_HostCopy(self.device), _HostCopy(self.device)] if self.distributed else []
        self._agreed_stop = False

    def _start_state(self) -> torch.Tensor:
        return torch.tensor([self.guard.consecutive, self.guard.skipped, 0.0, -1.0, 0.0, 0.0],
                            dtype=torch.float64, device=self.device)

    @torch.no_grad()
    def check(self, step: int, loss: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Whether to apply this step's update, decided on the device (no host read)."""
        if self._state is None:
            self._state = self._start_state()
        loss = loss.detach().to(self.device, torch.float64).reshape(())
        grad = grad.detach().to(self.device, torch.float64).reshape(())
        if self.distributed:
            stop = torch.full((), float(self.stop.requested), dtype=torch.float64, device=self.device)
            loss, grad, stops = all_reduce_sum(torch.stack([loss, grad, stop])).unbind()
            self._record_stop(stops)
        bad_loss = ~torch.isfinite(loss)
        bad = bad_loss | ~torch.isfinite(grad)
        state = self._state
        consecutive = (state[_CONSECUTIVE] + 1) * bad
        new = torch.stack([
            consecutive,
            state[_SKIPPED] + bad,
            (consecutive > self.guard.limit).to(torch.float64),
            torch.where(bad, float(step), state[_LAST_STEP]),
            torch.where(bad, torch.where(bad_loss, _LOSS, _GRAD), state[_LAST_WHAT]),
            torch.where(bad, torch.where(bad_loss, loss, grad), state[_LAST_VALUE]),
        ])
        tripped = state[_TRIPPED] > 0  # frozen at the step that passed the limit: no update after it
        self._state = torch.where(tripped, state, new)
        return ~bad & ~tripped

    def _record_stop(self, stops: torch.Tensor) -> None:
        now, previous = self._stop_flags
        if not self.lag:
            now.push(stops)
            self._agreed_stop = now.read() > 0
            return
        if previous.pending:  # the step before's flag: its event is behind the work queued since
            self._agreed_stop = previous.read() > 0
        now.push(stops)
        self._stop_flags.reverse()

    def stop_now(self) -> bool:
        """Whether to stop after this step (the same answer on every rank)."""
        return self._agreed_stop if self.distributed else self.stop.requested

    def sync(self, step: int, *extra: torch.Tensor) -> list[float]:
        """The host reads the counters (one copy, with ``extra`` 0-d tensors, whose values are returned):
        skipped updates are logged, and ``NonFiniteError`` raised when the limit was passed. Every rank
        calls it at the same steps."""
        parts = [t.detach().to(self.device, torch.float64).reshape(1) for t in extra]
        if self._state is None:
            return torch.cat(parts).tolist() if parts else []
        values = torch.cat([self._state, *parts]).tolist()
        consecutive, skipped, tripped, last_step, what, value = values[:6]
        self.guard.settle(step, int(consecutive), int(skipped), int(last_step),
                          "loss" if what == _LOSS else self.grad_what, value, tripped > 0)
        return values[6:]


def check_compile_setting(setting: Any, key: str = "train.compile") -> None:
    """Raise ValueError naming ``key`` unless ``setting`` is true, false/None or a backend name."""
    if not (setting is None or isinstance(setting, bool) or (isinstance(setting, str) and setting)):
        raise ValueError(f"{key}={setting!r} must be true, false or a torch.compile backend name (e.g. aot_eager)")


def compiled(module: nn.Module, setting: bool | str | None, key: str = "train.compile") -> nn.Module:
    """``train.compile`` / ``sample.compile``: ``module`` through ``torch.compile`` (true: the default
    inductor backend; a string: that backend, e.g. ``aot_eager``), or as it is (false). The weights
    stay the module's: optimizer, EMA and checkpoints see the same parameters."""
    check_compile_setting(setting, key)
    if not setting:
        return module
    return torch.compile(module) if setting is True else torch.compile(module, backend=setting)
