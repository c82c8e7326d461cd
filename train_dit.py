"""Class-conditional DiT / MoH-DiT: train, sample, evaluate, cache latents (see conf/train_dit.yaml).

    python train_dit.py                      tiny MoH-DiT on digits (pixel space), sample, FID
    torchrun --nproc_per_node=N train_dit.py ...

Exit codes: 0 done, 1 error (e.g. non-finite training: results.json says ``completed: false`` and
why), 75 stopped by SIGTERM / SIGUSR1 / SIGUSR2 after saving a checkpoint (run again to continue).
Under SLURM the job is requeued and resumes by itself (docs/clusters.md).
"""

from __future__ import annotations

import json
import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from visattn.engine.dit.setup import RUN_GROUPS
from visattn.engine.dit.trainer import run
from visattn.engine.launch import launched_rank, prepare_entry_point, reported_failures
from visattn.engine.training_run import adopt_training_config

log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path="conf", config_name="train_dit")
def main(cfg: DictConfig) -> None:
    with reported_failures():  # a failure is in the run's log; a stop with its state saved exits 75
        cfg = adopt_training_config(cfg, RUN_GROUPS, HydraConfig.get().overrides.task, modes=("sample", "eval"))
        results = run(OmegaConf.to_container(cfg, resolve=True), HydraConfig.get().runtime.output_dir)
    if launched_rank() == 0:
        summary = {k: v for k, v in results.items() if k != "config"}
        print(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    prepare_entry_point(sys.argv)
    main()
