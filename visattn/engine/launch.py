"""The launch layer both entry points share: Hydra under torchrun / SLURM, threads, the process
group, one run dir agreed by all ranks, logging, the run-dir lock, leftovers of interrupted saves,
and the stop signals (preemption).

    with launched(cfg.device, cfg.train.num_threads, run_dir) as ctx:   # ctx.dist, ctx.run_dir, ctx.stop
        ...
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

from .checkpoints import remove_stale
from .distributed import DistInfo, broadcast_object, cleanup_distributed, init_distributed
from .preempt import StopSignal
from .runlock import RunDirBusy, RunLock, refuse_busy_run_dir
from .runlog import setup_logging

log = logging.getLogger(__name__)


def register_resolvers() -> None:
    """``${pid:}`` for the default run dirs: runs started in the same second get different dirs."""
    OmegaConf.register_new_resolver("pid", lambda: str(os.getpid()), replace=True)


def launched_rank() -> int:
    """This process's rank as torchrun set it (0 when not launched by torchrun); valid before and
    after the process group exists."""
    return int(os.environ.get("RANK", "0"))


def worker_rank_overrides(argv: Sequence[str]) -> list[str]:
    """Hydra overrides for torchrun ranks other than 0, so they make no run dir of their own
    (rank 0's run dir is shared with them by ``agreed_run_dir``)."""
    if launched_rank() == 0 or "-m" in argv or "--multirun" in argv:
        return []
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"]


def export_slurm_env() -> None:
    """Under a multi-task SLURM job started by submitit (hydra/launcher=slurm), set the torchrun
    variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) from SLURM's."""
    if "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) < 2 or "SUBMITIT_FOLDER" not in os.environ:
        return
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export()


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


@contextlib.contextmanager
def launched(device: str, num_threads: int | None, local_run_dir: str | Path) -> Iterator[Launched]:
    """Threads, process group (torchrun), logging, the agreed run dir, its lock and the stop
    signals, undone on exit. ``device``: auto | cpu | cuda."""
    if num_threads:
        torch.set_num_threads(int(num_threads))
    dist = init_distributed(None if device == "auto" else device)
    try:
        setup_logging(dist.rank)
        run_dir = agreed_run_dir(local_run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with hold_run_dir(run_dir, dist), StopSignal() as stop:
            yield Launched(dist, run_dir, stop)
    finally:
        cleanup_distributed()


def prepare_entry_point(argv: list[str]) -> None:
    """What both entry points do before ``@hydra.main`` runs: keep freed buffers in the process, take
    SLURM's rank variables, register our resolvers, refuse a run dir held by a live run (before Hydra
    writes ``.hydra/`` into it), and point torchrun's other ranks at rank 0's run dir. Edits ``argv``
    (``sys.argv``) in place."""
    tune_glibc_malloc()
    export_slurm_env()
    register_resolvers()
    if launched_rank() == 0:  # (other ranks share rank 0's run dir, which rank 0 may hold already)
        try:
            refuse_busy_run_dir(argv[1:])
        except RunDirBusy as busy:
            sys.exit(f"error: {busy}")
    argv += worker_rank_overrides(argv)
