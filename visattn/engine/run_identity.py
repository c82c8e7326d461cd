"""A run dir belongs to one run: every checkpoint records the config that defines its run, and
``resume`` continues a checkpoint only for the same definition.

The definition is the whole config (model, attention, budget, data, augmentation, optimiser,
schedule, training length, seed, evaluation) less the run-only keys below: how a run is executed
(threads, devices, compilation, TF32, MoH's training-path probe, progress bars, logging and checkpoint cadence, where to resume
from), which may change between the sittings of one run. A different definition into a run dir that holds a
checkpoint is refused before anything is written, naming the keys that differ:

    run dir outputs/x holds a checkpoint of another run: seed 0 -> 2, train.epochs 2 -> 1. ...

Two ways on: another run dir, or ``force_resume=true`` (results.json then records the differences
as ``resumed_despite``). Continuing a run with a longer training (``train.epochs`` / ``train.steps``
raised, nothing else changed) is the one change accepted as the same run: results.json records it
as ``continued_from``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

RUN_ONLY_KEYS = (
    "mode", "ckpt", "resume", "force_resume", "device",
    "train.num_threads", "train.progress", "train.tensorboard", "train.log_every", "train.ckpt_every",
    "train.compile", "train.tf32", "train.attn_paths",
    "train.eval_every", "train.eval_batch_size", "train.stop_after_epoch",
    "data.num_workers", "sample.batch_size", "sample.compile", "eval.extractor_device", "cache",
)
TRAINING_LENGTH_KEYS = ("train.epochs", "train.steps")


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out if out or not prefix else {prefix[:-1]: {}}
    return {prefix[:-1]: list(node) if isinstance(node, (list, tuple)) else node}


def _run_only(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in RUN_ONLY_KEYS)


def run_definition(config: Mapping[str, Any]) -> dict[str, Any]:
    """The keys (dotted) and values of ``config`` (plain, resolved) that define the run."""
    return {k: v for k, v in sorted(_flatten(config).items()) if not _run_only(k)}


@dataclass(frozen=True)
class Difference:
    key: str
    saved: Any
    current: Any

    def __str__(self) -> str:
        def shown(value: Any) -> str:
            return "(absent)" if value is _MISSING else repr(value)

        return f"{self.key} {shown(self.saved)} -> {shown(self.current)}"


_MISSING = object()


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[Difference]:
    return [Difference(k, saved.get(k, _MISSING), current.get(k, _MISSING))
            for k in sorted(set(saved) | set(current)) if saved.get(k, _MISSING) != current.get(k, _MISSING)]


def _longer_training(diffs: list[Difference]) -> bool:
    return bool(diffs) and all(
        d.key in TRAINING_LENGTH_KEYS and isinstance(d.saved, int) and isinstance(d.current, int)
        and d.current > d.saved for d in diffs)


class RunMismatch(ValueError):
    """A run asked to resume a checkpoint that another run's config made."""


def check_same_run(saved: Mapping[str, Any] | None, current: Mapping[str, Any], run_dir: Any, step: int,
                   force: bool) -> dict[str, Any]:
    """Compare the definition a checkpoint (of ``step``, in ``run_dir``) recorded with this run's.
    Returns what results.json records about an accepted difference ({} when none); raises
    ``RunMismatch`` naming the keys and the fix when the runs differ and ``force`` is off."""
    if saved is None:
        log.warning("the checkpoint of step %d in %s records no run config (saved by an older version): "
                    "resuming it without checking that it is this run's", step, run_dir)
        return {}
    diffs = differences(saved, current)
    if not diffs:
        return {}
    listed = ", ".join(str(d) for d in diffs)
    if _longer_training(diffs):
        log.info("continuing the run in %s (checkpoint of step %d) with a longer training: %s", run_dir, step, listed)
        return {"continued_from": {d.key: d.saved for d in diffs}}
    if force:
        log.warning("force_resume=true: resuming the checkpoint of step %d in %s, which another config made: %s",
                    step, run_dir, listed)
        return {"resumed_despite": {d.key: [_plain(d.saved), _plain(d.current)] for d in diffs}}
    raise RunMismatch(
        f"run dir {run_dir} holds a checkpoint (step {step}) of another run: {listed}. Nothing was written. "
        "Give this run its own directory (hydra.run.dir=...), or continue that checkpoint with this config "
        "anyway with force_resume=true (results.json records the differences); only a longer training "
        "(train.epochs / train.steps raised) continues a run as it is"
    )


def _plain(value: Any) -> Any:
    return None if value is _MISSING else value
