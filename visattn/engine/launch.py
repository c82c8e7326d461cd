"""Launch plumbing shared by the entry points: Hydra under torchrun / SLURM, one run dir for all ranks."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from .distributed import broadcast_object


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
