"""Training checkpoints as one unit: a directory per saved step, written aside and renamed into place.

Layout (both tasks)::

    RUN_DIR/checkpoints/step-000001200/
        model.safetensors   the trained weights (safetensors; metadata: step)
        ema.safetensors     the EMA weights, when the run keeps them
        state.pt            optimizer, step, data position, every rank's RNG, ... (torch.load(weights_only=True))
        manifest.json       written last: format, step, every file and its size, and the config that
                            defines the run (``run``: see ``run_identity``)
        evaluation.json     optional, added after the save: the evaluation of these weights (``record_evaluation``)

A save writes ``step-N.tmp-<pid>/``, fsyncs every file, writes the manifest, renames the folder to
``step-N`` (atomic: the name did not exist) and only then deletes the older ``step-*`` folders. A
kill at any instant therefore leaves at least one complete, verifiable checkpoint (or none before the
first save); the loader takes the newest folder whose manifest verifies and ignores half-written ones.
``remove_stale`` (called at start, under the run-dir lock) deletes what an interrupted save left.

``evaluation.json`` is outside the manifest: the checkpoint is complete with or without it. A loop
that saves before it evaluates (so a stop during a long evaluation loses no training) adds it once
the evaluation is done, atomically, so a resume knows whether to evaluate again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from visattn.utils.checkpoint import (
    TEMP_SUFFIX,
    atomic_write_bytes,
    fsync_dir,
    read_safetensors,
    read_torch_file,
    save_train_state,
    save_weights,
)

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
MANIFEST = "manifest.json"
MODEL_WEIGHTS = "model.safetensors"
EMA_WEIGHTS = "ema.safetensors"
TRAIN_STATE = "state.pt"
EVALUATION = "evaluation.json"
FORMAT = "visattn-checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TEMP_DIR = re.compile(r"^step-\d+\.tmp-\d+$")


def checkpoints_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint folder (its manifest verified)."""

    path: Path
    step: int
    files: tuple[str, ...]
    run: dict[str, Any] | None = None  # the run definition it was saved under (None: an older checkpoint)

    def weights(self, name: str = MODEL_WEIGHTS) -> dict[str, torch.Tensor]:
        if name not in self.files:
            raise FileNotFoundError(f"{self.path} has no {name} (it holds {list(self.files)})")
        return read_safetensors(self.path / name)

    def state(self) -> dict[str, Any]:
        state = read_torch_file(self.path / TRAIN_STATE)
        if not isinstance(state, dict) or state.get("step") != self.step:
            raise ValueError(f"{self.path / TRAIN_STATE} does not hold the training state of step {self.step} "
                             f"that {self.path / MANIFEST} names; the folder was altered after it was saved")
        return state

    def evaluation(self) -> dict[str, Any] | None:
        """What ``record_evaluation`` added to this checkpoint (None: it was not evaluated after the save)."""
        path = self.path / EVALUATION
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{path} is not a JSON evaluation record ({type(err).__name__}: {err}); delete it "
                             "to evaluate this checkpoint again on resume") from None
        if not isinstance(record, dict) or record.get("step") != self.step:
            raise ValueError(f"{path} does not record an evaluation of step {self.step} that {self.path / MANIFEST} "
                             "names; the folder was altered after it was saved (delete the file to evaluate again)")
        return record


def verify_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint in folder ``path``; ValueError naming the file and the expected format when the
    manifest is missing or unreadable or a file it lists is missing or of another size."""
    path = Path(path)
    manifest_path = path / MANIFEST
    expected = f"a {FORMAT} manifest (JSON with format, step and files), written last by a complete save"
    try:
        manifest = json.loads(manifest_path.read_text())
        step, files = int(manifest["step"]), dict(manifest["files"])
        if manifest.get("format") != FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{manifest_path} is not {expected} ({type(err).__name__}: {err}); the save was "
                         "interrupted or the folder is not a checkpoint") from None
    for name, size in files.items():
        file = path / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            raise ValueError(f"{file} should be {size} bytes as {manifest_path} records, but is "
                             f"{'missing' if actual is None else f'{actual} bytes'}; the checkpoint is damaged")
    run = manifest.get("run")
    return Checkpoint(path, step, tuple(files), run if isinstance(run, dict) else None)


def step_dirs(run_dir: str | Path) -> list[Path]:
    """The ``step-N`` folders under the run's checkpoints folder, newest first."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint of a run dir (None when there is none)."""
    for path in step_dirs(run_dir):
        try:
            return verify_checkpoint(path)
        except ValueError as err:
            log.warning("skipping an incomplete checkpoint: %s", err)
    return None


def resolve_checkpoint(path: str | Path) -> Checkpoint:
    """A checkpoint folder, or a run dir (its newest checkpoint)."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return verify_checkpoint(path)
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path} holds no complete checkpoint (no {CHECKPOINT_DIR}/step-N/{MANIFEST}); "
                                "give a run dir that saved one, or a checkpoint folder")
    return found


def _write_manifest(folder: Path, step: int, run: Mapping[str, Any] | None) -> None:
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    manifest = {"format": FORMAT, "step": step, "files": files, **({"run": dict(run)} if run is not None else {})}
    text = json.dumps(manifest, indent=2, default=str) + "\n"
    with open(folder / MANIFEST, "w") as f:  # the folder itself is the temp: a plain write is enough
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(folder)


def save_checkpoint(run_dir: str | Path, step: int, weights: Mapping[str, Mapping[str, torch.Tensor]],
                    state: Mapping[str, Any], run: Mapping[str, Any] | None = None) -> Checkpoint:
    """Save one checkpoint (``weights``: file name -> state dict, e.g. ``{MODEL_WEIGHTS: ...}``;
    ``state``: the training state, which must hold ``step``; ``run``: the run definition,
    ``run_identity.run_definition``). Returns it; older ones are deleted."""
    if state.get("step") != step:
        raise ValueError(f"state['step']={state.get('step')} differs from the step {step} being saved")
    root = checkpoints_root(run_dir)
    final = root / step_dir_name(step)
    if final.is_dir():  # the same step saved again (e.g. preempted right after a periodic save)
        try:
            return verify_checkpoint(final)
        except ValueError:
            shutil.rmtree(final)
    temp = root / f"{final.name}.tmp-{os.getpid()}"
    if temp.exists():
        shutil.rmtree(temp)
    temp.mkdir(parents=True)
    for name, tensors in weights.items():
        save_weights(temp / name, tensors, {"step": str(step)})
    save_train_state(temp / TRAIN_STATE, state)
    _write_manifest(temp, step, run)
    os.rename(temp, final)
    fsync_dir(root)
    for older in step_dirs(run_dir):
        if older != final:
            shutil.rmtree(older, ignore_errors=True)
    return verify_checkpoint(final)


def record_evaluation(run_dir: str | Path, step: int, record: Mapping[str, Any]) -> None:
    """Add ``record`` (JSON-serialisable: metrics, ...) to the checkpoint of ``step`` as ``evaluation.json``,
    atomically: a resume sees the whole record or none (``Checkpoint.evaluation``)."""
    folder = checkpoints_root(run_dir) / step_dir_name(step)
    if not (folder / MANIFEST).is_file():
        raise FileNotFoundError(f"{folder} holds no checkpoint; save step {step} before recording its evaluation")
    text = json.dumps({"step": step, **record}, indent=2) + "\n"
    atomic_write_bytes(folder / EVALUATION, text.encode())
    fsync_dir(folder)


def remove_stale(run_dir: str | Path) -> list[Path]:
    """Delete what interrupted saves left in a run dir (temp folders, temp files) and checkpoints
    older than the newest complete one. Call only while holding the run dir's lock."""
    run_dir = Path(run_dir)
    removed: list[Path] = []
    root = checkpoints_root(run_dir)
    for folder in (run_dir, root, *step_dirs(run_dir)):  # in a step folder: an interrupted record_evaluation
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if p.is_dir() and _TEMP_DIR.match(p.name):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
            elif p.is_file() and p.name.startswith(".") and p.name.endswith(TEMP_SUFFIX):
                p.unlink(missing_ok=True)
                removed.append(p)
    newest = latest_checkpoint(run_dir)
    for p in step_dirs(run_dir):
        if newest is not None and p != newest.path:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if removed:
        log.info("removed %d leftovers of interrupted saves: %s", len(removed), ", ".join(p.name for p in removed))
    return removed


def checkpoint_to_resume(resume: Any, run_dir: str | Path) -> Checkpoint | None:
    """The checkpoint the ``resume`` setting asks for: false -> None (start afresh); auto -> the run
    dir's newest complete checkpoint, or None; true -> that one, which must exist."""
    if resume is False or resume is None:
        return None
    found = latest_checkpoint(run_dir)
    if found is None and resume != "auto":
        raise FileNotFoundError(
            f"resume={resume}: {checkpoints_root(run_dir)} holds no complete checkpoint; resume in the run dir of "
            "a run that saved one (resume=RUN_DIR, or hydra.run.dir=RUN_DIR resume=true), or use resume=auto"
        )
    return found
