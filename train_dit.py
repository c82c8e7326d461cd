"""Class-conditional DiT / MoH-DiT: train, sample, evaluate, cache latents (see conf/train_dit.yaml).

    python train_dit.py                      tiny MoH-DiT on digits (pixel space), sample, FID
    torchrun --nproc_per_node=N train_dit.py ...

Exit codes: 0 done, 1 error (e.g. non-finite training: results.json says ``completed: false`` and
why), 75 stopped by SIGTERM / SIGUSR1 / SIGUSR2 after saving a checkpoint (run again to continue).
"""

from __future__ import annotations

import json
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from visattn.engine.dit_trainer import run
from visattn.engine.launch import export_slurm_env, launched_rank, register_resolvers, worker_rank_overrides
from visattn.engine.preempt import Preempted, exit_preempted
from visattn.engine.runlock import RunDirBusy, refuse_busy_run_dir
from visattn.utils.allocator import tune_glibc_malloc


@hydra.main(version_base="1.3", config_path="conf", config_name="train_dit")
def main(cfg: DictConfig) -> None:
    try:
        results = run(OmegaConf.to_container(cfg, resolve=True), HydraConfig.get().runtime.output_dir)
    except Preempted as stop:
        exit_preempted(stop)  # checkpoint and results.json are written; exits 75 (or submitit requeues)
    if launched_rank() == 0:
        summary = {k: v for k, v in results.items() if k != "config"}
        print(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    tune_glibc_malloc()
    export_slurm_env()
    register_resolvers()
    if launched_rank() == 0:  # (other ranks share rank 0's run dir, which rank 0 may hold already)
        try:
            refuse_busy_run_dir(sys.argv[1:])  # before Hydra writes .hydra/ into another live run's dir
        except RunDirBusy as busy:
            sys.exit(f"error: {busy}")
    sys.argv += worker_rank_overrides(sys.argv)
    main()
