"""Preemption: SIGTERM / SIGUSR1 / SIGUSR2, whenever they arrive during a run, stop it at the next
safe point with its state saved: after the current training step (checkpoint), or after the
current batch of an evaluation or of the final sampling (the checkpoint before it already holds the
weights; the resumed run evaluates them without training again).

The loop checks ``StopSignal.requested`` once per step (agreed over ranks), writes a checkpoint and
results.json (``completed: false, preempted: true``) and raises ``Preempted``. Under SLURM the launch
layer then has rank 0 requeue the job (``launch.stop_and_requeue``: submitit's protocol, which counts
time-outs against ``max_num_timeout``, or ``scontrol requeue``). The entry point calls
``exit_preempted``, which exits with ``PREEMPTED_EXIT_CODE`` = 75 (EX_TEMPFAIL: "try again"), so a
scheduler or a wrapper script can tell a resumable stop from a failure (1) and a finished run (0).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sized
from types import FrameType
from typing import Any

import torch

from .distributed import all_reduce_max, all_reduce_sum

log = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class Preempted(Exception):
    """Raised by a training loop after it saved its state on a stop signal. ``not_requeued``: under
    SLURM, why rank 0's requeue was refused (None: requeued, or not a SLURM job)."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; state saved, resume to continue")
        self.signum, self.step = signum, step
        self.not_requeued: str | None = None


class StopSignal:
    """Context manager: while inside (the whole run, from the launch layer), the stop signals set
    ``received`` instead of killing the process; the run acts on it at its next safe point (the end
    of a training step, of an evaluation or sampling batch). Handlers are only installed from the
    main thread (Python's rule); elsewhere this is inert."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            log.warning("received %s: stopping at the next safe point (end of the step or batch), with the "
                        "state saved", signal.Signals(signum).name)

    def previous_handlers(self) -> list[Any]:
        """The handlers ours replaced (submitit's, under submitit)."""
        return list(self._previous.values())

    def preempted(self, step: int) -> Preempted:
        """The exception to raise after saving. Under DDP a rank may stop because another rank got the
        signal (the ranks agree on stopping): it reports SIGTERM."""
        return Preempted(self.received if self.received is not None else signal.SIGTERM, step)

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def stop_checked(batches: Sized, stop: StopSignal | None, step: int, device: torch.device) -> Iterator[Any]:
    """The items of ``batches`` (an evaluation's or sampling's batches, of known length), with a stop
    check before each that every rank agrees on (one all-reduce), so that all ranks raise ``Preempted``
    (at ``step``, the checkpoint holding the weights evaluated) after the same batch. A rank with fewer
    batches than another takes part in the remaining checks without a batch."""
    if stop is None:
        yield from batches
        return
    if not torch.distributed.is_initialized():  # one process: the flag itself, no tensor and no device sync
        for item in batches:
            if stop.requested:
                raise stop.preempted(step)
            yield item
        return
    items = iter(batches)
    for _ in range(all_reduce_max(len(batches), device)):
        flag = torch.tensor([float(stop.requested)], device=device, dtype=torch.float64)
        if all_reduce_sum(flag).item() > 0:
            raise stop.preempted(step)
        item = next(items, _DONE)
        if item is not _DONE:
            yield item


_DONE = object()


def exit_preempted(stop: Preempted) -> None:
    """Exit after a stop whose state is saved: ``PREEMPTED_EXIT_CODE``; under SLURM, ranks other than 0
    exit 0 (rank 0 speaks for the job; a non-zero exit would make ``srun --kill-on-bad-exit`` stop it
    while it requeues). A SLURM job that was not requeued under submitit raises instead, so that
    submitit records the job as ended (the ``-m`` process stops waiting) and the sweep fails."""
    from .slurm import in_slurm_job

    log.warning("%s", stop)
    if stop.not_requeued is not None and _under_submitit():
        raise RuntimeError(f"{stop}; the SLURM job was not requeued: {stop.not_requeued}")
    rank = int(os.environ.get("RANK", "0"))
    sys.exit(0 if in_slurm_job() and rank != 0 else PREEMPTED_EXIT_CODE)


def _under_submitit() -> bool:
    return "SUBMITIT_EXECUTOR" in os.environ or "SUBMITIT_FOLDER" in os.environ
