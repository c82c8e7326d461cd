"""The launch layer both entry points share: Hydra under torchrun / SLURM, threads, the process
group, one run dir agreed by all ranks, logging, the run-dir lock, the run's identity, leftovers of
interrupted saves, and the stop signals (preemption, with the requeue under SLURM).

    with launched(cfg.device, cfg.train.num_threads, run_dir, config) as ctx:   # ctx.dist, ctx.run_dir, ctx.stop
        ...

Whatever starts a process (``python``, ``torchrun``, ``srun``, submitit's pickled task function),
``prepare_process`` runs first in it: under a multi-task SLURM step it sets torchrun's variables, so
an N-task job is one run of N processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from visattn.utils.allocator import tune_glibc_malloc
from visattn.utils.checkpoint import atomic_write_bytes

from .checkpoints import checkpoint_to_resume, remove_stale
from .distributed import DistInfo, broadcast_object, cleanup_distributed, init_distributed
from .preempt import Preempted, StopSignal, exit_preempted
from .run_identity import RunMismatch, check_same_run, run_definition
from .runlock import RunDirBusy, RunLock, refuse_busy_run_dir
from .runlog import setup_logging
from .slurm import export_task_env, in_slurm_job, request_requeue

log = logging.getLogger(__name__)

HYDRA_RECORD_DIR = ".hydra"


def register_resolvers() -> None:
    """``${pid:}`` for the default run dirs: runs started in the same second get different dirs."""
    OmegaConf.register_new_resolver("pid", lambda: str(os.getpid()), replace=True)


def launched_rank() -> int:
    """This process's rank as torchrun (or ``prepare_process`` under SLURM) set it (0 in a single
    process); valid before and after the process group exists."""
    return int(os.environ.get("RANK", "0"))


def worker_rank_overrides(argv: Sequence[str]) -> list[str]:
    """Hydra overrides for torchrun ranks other than 0, so they make no run dir of their own
    (rank 0's run dir is shared with them by ``agreed_run_dir``)."""
    if launched_rank() == 0 or "-m" in argv or "--multirun" in argv:
        return []
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"]


def agreed_run_dir(local_run_dir: str | Path) -> Path:
    """Rank 0's run dir, on every rank."""
    return Path(broadcast_object(str(local_run_dir)))


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class Launched:
    dist: DistInfo
    run_dir: Path
    stop: StopSignal
    resume_notes: dict  # what results.json records of an accepted config change on resume (run_identity)


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, dist: DistInfo) -> Iterator[None]:
    """Rank 0 takes the run dir's lock and removes leftovers of interrupted saves; every rank
    raises ``RunDirBusy`` when the dir is held by another live run."""
    lock = RunLock(run_dir)
    error = None
    if dist.is_main:
        try:
            lock.acquire()
        except RunDirBusy as err:
            error = str(err)
    error = broadcast_object(error)
    if error is not None:
        raise RunDirBusy(error)
    try:
        if dist.is_main:
            remove_stale(run_dir)
        yield
    finally:
        lock.release()


def check_run_identity(run_dir: Path, config: dict, dist: DistInfo) -> dict:
    """Rank 0 compares the run dir's checkpoint with this run (``run_identity``); every rank gets the
    notes for results.json or raises the same ``RunMismatch``."""
    outcome: tuple[str, object] = ("ok", {})
    if dist.is_main and config.get("mode", "train") == "train" and config.get("resume") not in (False, None):
        found = checkpoint_to_resume("auto", run_dir)
        if found is not None:
            try:
                outcome = ("ok", check_same_run(found.run, run_definition(config), run_dir, found.step,
                                                bool(config.get("force_resume"))))
            except RunMismatch as err:
                outcome = ("refused", str(err))
    kind, value = broadcast_object(outcome)
    if kind == "refused":
        raise RunMismatch(value)
    return dict(value)


def save_hydra_record(run_dir: Path, config: dict) -> None:
    """``RUN_DIR/.hydra/{config,hydra,overrides}.yaml``, as Hydra writes them, once the run is known to
    own the dir (the configs set ``hydra.output_subdir: null`` so that Hydra itself does not write them
    before the run-dir lock and the identity check)."""
    from hydra.core.hydra_config import HydraConfig

    folder = run_dir / HYDRA_RECORD_DIR
    folder.mkdir(exist_ok=True)
    files = {"config.yaml": OmegaConf.create(config)}
    if HydraConfig.initialized():
        hydra_cfg = HydraConfig.get()
        files.update({"hydra.yaml": OmegaConf.create({"hydra": hydra_cfg}), "overrides.yaml": hydra_cfg.overrides.task})
    for name, node in files.items():
        atomic_write_bytes(folder / name, OmegaConf.to_yaml(node).encode())


def stop_and_requeue(stop: Preempted, dist: DistInfo, signals: StopSignal) -> None:
    """After a stop's checkpoint, under SLURM: rank 0 asks for the requeue (submitit's protocol, or
    ``scontrol requeue``); ``stop.not_requeued`` says why it was refused. No collective: a stop during
    the final evaluation reaches the ranks at different batches. The other ranks exit 0 afterwards
    (``exit_preempted``), so ``srun --kill-on-bad-exit`` cannot stop rank 0 before it has asked."""
    if not (in_slurm_job() and dist.is_main):
        return
    stop.not_requeued = request_requeue(stop.signum, signals.previous_handlers())
    if stop.not_requeued is None:
        log.warning("SLURM job requeued: it resumes from the checkpoint of step %d", stop.step)
    else:
        log.warning("the SLURM job was not requeued (%s); run it again in the same run dir to resume",
                    stop.not_requeued)


@contextlib.contextmanager
def launched(device: str, num_threads: int | None, local_run_dir: str | Path,
             config: dict | None = None) -> Iterator[Launched]:
    """Threads, process group, logging, the agreed run dir, its lock, the run's identity (``config``:
    the run's plain config; a training's checkpoint in the dir must be this run's), the record of the
    config in ``.hydra/``, and the stop signals, undone on exit. ``device``: auto | cpu | cuda.
    A ``Preempted`` raised inside is followed by the requeue under SLURM (``stop_and_requeue``)."""
    if num_threads:
        torch.set_num_threads(int(num_threads))
    dist = init_distributed(None if device == "auto" else device)
    try:
        setup_logging(dist.rank)
        run_dir = agreed_run_dir(local_run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with hold_run_dir(run_dir, dist), StopSignal() as stop:
            notes = check_run_identity(run_dir, config, dist) if config is not None else {}
            if dist.is_main and config is not None:
                save_hydra_record(run_dir, config)
            try:
                yield Launched(dist, run_dir, stop, notes)
            except Preempted as stopped:
                stop_and_requeue(stopped, dist, stop)
                raise
    finally:
        cleanup_distributed()


@contextlib.contextmanager
def reported_failures() -> Iterator[None]:
    """Around an entry point's work: a stop with its state saved exits as ``exit_preempted`` says; any
    failure goes to the run's log (every rank's, as Hydra configured it) before it propagates, so
    under a launcher that keeps exceptions elsewhere (submitit's result pickle) the log still says why."""
    try:
        yield
    except Preempted as stop:
        exit_preempted(stop)
    except (ValueError, FileNotFoundError) as err:  # a bad value or a missing file: the message says it all
        log.error("%s", err)
        raise
    except Exception:
        log.exception("the run failed")
        raise


def prepare_process() -> None:
    """What every process of a run does before Hydra composes its config, whoever started it (the
    entry points' ``__main__``, the SLURM launcher in a submitit job): keep freed buffers in the
    process, take torchrun's variables from a multi-task SLURM step, register our resolvers."""
    tune_glibc_malloc()
    export_task_env()
    register_resolvers()


def prepare_entry_point(argv: list[str]) -> None:
    """What both entry points do before ``@hydra.main`` runs: ``prepare_process``, refuse a run dir
    held by a live run (before Hydra opens its log there), and point the other ranks at rank 0's
    run dir. Edits ``argv`` (``sys.argv``) in place."""
    prepare_process()
    if launched_rank() == 0:  # (other ranks share rank 0's run dir, which rank 0 may hold already)
        try:
            refuse_busy_run_dir(argv[1:])
        except RunDirBusy as busy:
            sys.exit(f"error: {busy}")
    argv += worker_rank_overrides(argv)
