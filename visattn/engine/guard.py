"""Non-finite guard: a step whose loss or gradients (their norm, when clipping computes one) hold
NaN / inf is skipped (no optimizer step, no EMA update), counted and logged; more than
``train.max_nonfinite_steps`` such steps IN A ROW stop the run with ``NonFiniteError`` (an isolated
overflow is survivable, a diverged run is not). Weights are checked before every save, so a
non-finite checkpoint is never written. The training loops count on the device (``step.StepGate``)
and report here at their log and save points (``settle``): skips are logged, and the limit acted on,
there.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """The run stopped on non-finite numbers; ``failure`` is what results.json records."""

    def __init__(self, message: str, failure: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.failure = {"reason": "non_finite", "message": message, **failure}


class NonFiniteGuard:
    """Counts skipped steps. ``limit``: how many consecutive non-finite steps are tolerated (0: stop
    at the first). ``cause_hint``: the likely causes in this run's own terms (its lr, amp, data)."""

    def __init__(self, limit: int, cause_hint: str) -> None:
        if limit < 0:
            raise ValueError(f"train.max_nonfinite_steps={limit} must be >= 0 (0 = stop at the first one)")
        self.limit = limit
        self.cause_hint = cause_hint
        self.consecutive = 0
        self.skipped = 0

    def check(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when the step's numbers are finite (apply the update); False to skip it. Raises
        ``NonFiniteError`` once more than ``limit`` steps in a row were non-finite. (The training loops
        count on the device instead, through ``step.StepGate``, which reports to ``settle``.)"""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped += 1
        what, value = ("loss", loss) if not math.isfinite(loss) else ("gradient norm", grad_norm)
        log.warning("step %d: %s is %s; update skipped (%d in a row, %d in all; train.max_nonfinite_steps=%d)",
                    step, what, value, self.consecutive, self.skipped, self.limit)
        if self.consecutive > self.limit:
            raise self._error(step, what, value)
        return False

    def settle(self, step: int, consecutive: int, skipped: int, last_step: int, what: str, value: float,
               tripped: bool) -> None:
        """Take the counts kept on the device, read at ``step`` (a log or save point): ``last_step`` is
        the last non-finite step (``what`` was ``value`` there). Logs the updates skipped since the
        last read; raises ``NonFiniteError`` when ``tripped`` (the counts then are those of the step
        that passed the limit, ``last_step``)."""
        new = skipped - self.skipped
        self.consecutive, self.skipped = consecutive, skipped
        if new > 0:
            log.warning("steps up to %d: %d update(s) skipped for non-finite numbers (the last at step %d: %s "
                        "%s); %d in a row, %d in all (train.max_nonfinite_steps=%d)", step, new, last_step, what,
                        _shown(what, value), consecutive, skipped, self.limit)
        if tripped:
            raise self._error(last_step, what, value)

    def _error(self, step: int, what: str, value: float) -> NonFiniteError:
        shown = _shown(what, value)
        message = (
            f"training stopped at step {step}: the {what} {'held' if what == GRADIENTS else 'was'} {shown} for "
            f"{self.consecutive} steps in a row (train.max_nonfinite_steps={self.limit}). Likely causes: "
            f"{self.cause_hint}"
        )
        return NonFiniteError(message, {"step": step, "what": what, "value": shown,
                                        "consecutive": self.consecutive, "skipped_steps": self.skipped})

    def state_dict(self) -> dict[str, int]:
        return {"consecutive": self.consecutive, "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, int] | None) -> None:
        if state:
            self.consecutive, self.skipped = int(state["consecutive"]), int(state["skipped"])


GRADIENTS = "gradients"  # what the guard calls the gradients when no norm was computed (clipping off)


def _shown(what: str, value: float) -> str:
    return "nan/inf" if what == GRADIENTS else str(value)


def cause_hint(lr: float, amp: str, data: str) -> str:
    return (f"a learning rate too high (lr={lr}: lower it or add warm-up), an overflow in reduced precision "
            f"(train.amp={amp}: try train.amp=none), or bad input data (data={data}: check for NaN / corrupt samples)")


def require_finite(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], what: str,
                   step: int) -> None:
    """Raise ``NonFiniteError`` if any floating tensor holds NaN / inf: checked before every save."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, tensor in items:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            message = (f"not saving {what} at step {step}: {name} holds NaN / inf values. The previous "
                       "checkpoint is kept; lower the learning rate or check the data")
            raise NonFiniteError(message, {"step": step, "what": f"{what}: {name}", "value": "nan/inf"})
