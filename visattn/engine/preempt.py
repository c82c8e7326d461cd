"""Preemption: SIGTERM / SIGUSR1 / SIGUSR2 ask the training loop to stop after the current step
(outside the loop, e.g. during DiT's final evaluation, they act at once as they would without us;
classification evaluates inside the loop, after saving, and stops when the evaluation ends).

The loop checks ``StopSignal.requested`` once per step (agreed over ranks), writes a checkpoint and
results.json (``completed: false, preempted: true``) and raises ``Preempted``; the entry point then
calls ``exit_preempted``: it runs the handler that was installed before ours (under submitit,
SIGUSR2 is its time-out signal and its handler requeues the job) and exits with
``PREEMPTED_EXIT_CODE`` = 75 (EX_TEMPFAIL: "try again"), so a scheduler or a wrapper script can
tell a resumable stop from a failure (1) and a finished run (0).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class Preempted(Exception):
    """Raised by a training loop after it saved its state on a stop signal."""

    def __init__(self, signum: int, step: int, previous_handler: Any = None) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; state saved, resume to continue")
        self.signum, self.step, self.previous_handler = signum, step, previous_handler


class StopSignal:
    """Context manager: while inside, the stop signals set ``received`` instead of killing the process.
    Handlers are only installed from the main thread (Python's rule); elsewhere this is inert."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.deferring = False
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Inside (the training loop, which checks ``requested`` every step) a stop signal is
        recorded; outside (start-up, the final evaluation) it acts at once, as it would without
        us: the previous handler runs (submitit's requeue), or the signal's default action."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.deferring:
            previous = self._previous.get(signum)
            if callable(previous):
                previous(signum, frame)
                return
            if previous == signal.SIG_IGN:
                return
            log.warning("received %s outside the training loop: nothing to save, stopping now",
                        signal.Signals(signum).name)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.received is None:
            self.received = signum
            log.warning("received %s: stopping after the current step, with a checkpoint",
                        signal.Signals(signum).name)

    def previous_handler(self) -> Any:
        return self._previous.get(self.received) if self.received is not None else None

    def preempted(self, step: int) -> Preempted:
        """The exception to raise after saving. Under DDP a rank may stop because another rank got the
        signal (the ranks agree on stopping): it reports SIGTERM and runs no previous handler."""
        signum = self.received if self.received is not None else signal.SIGTERM
        return Preempted(signum, step, self.previous_handler())

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def exit_preempted(stop: Preempted) -> None:
    """Hand the signal to the handler that was there before ours (submitit's requeue), then exit
    with ``PREEMPTED_EXIT_CODE``."""
    log.warning("%s", stop)
    handler = stop.previous_handler
    if callable(handler):
        handler(stop.signum, None)  # submitit: checkpoint (re-submit the same job) and requeue; may exit
    sys.exit(PREEMPTED_EXIT_CODE)
