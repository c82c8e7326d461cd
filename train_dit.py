"""Class-conditional DiT / MoH-DiT: train, sample, evaluate, cache latents (see conf/train_dit.yaml).

    python train_dit.py                      tiny MoH-DiT on digits (pixel space), sample, FID
    torchrun --nproc_per_node=N train_dit.py ...
"""

from __future__ import annotations

import json
import logging

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from visattn.engine.distributed import cleanup_distributed, init_distributed
from visattn.engine.dit_trainer import run
from visattn.engine.runlog import setup_logging
from visattn.utils.allocator import tune_glibc_malloc

log = logging.getLogger("train_dit")


@hydra.main(version_base="1.3", config_path="conf", config_name="train_dit")
def main(cfg: DictConfig) -> None:
    tune_glibc_malloc()
    if cfg.train.num_threads:
        torch.set_num_threads(int(cfg.train.num_threads))
    dist = init_distributed(None if cfg.device == "auto" else cfg.device)
    setup_logging(dist.rank)
    try:
        results = run(OmegaConf.to_container(cfg, resolve=True), dist, HydraConfig.get().runtime.output_dir)
    finally:
        cleanup_distributed()
    if dist.is_main:
        summary = {k: v for k, v in results.items() if k != "config"}
        print(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
