"""Image classification with a ViT / TransNeXt and any registered attention (Hydra).

    python train_cls.py                          # small MoH ViT on digits (the demo)
    python train_cls.py -m attn=mha,moh          # sweep
    torchrun --nproc_per_node=2 train_cls.py     # DDP (gloo on CPU, nccl on GPU)
    python train_cls.py mode=eval ckpt=RUN_DIR   # top-1 / top-5 of a run's model (its model, attn, budget, data)

Configs: conf/train_cls.yaml and its groups. Prints the results (JSON) when done. Exit codes: 0 done,
1 error (e.g. non-finite training: results.json says ``completed: false`` and why), 75 stopped by
SIGTERM / SIGUSR1 / SIGUSR2 after saving a checkpoint (run again in the same run dir to continue).
Under SLURM the job is requeued and resumes by itself (docs/clusters.md).
"""

from __future__ import annotations

import json
import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from visattn.engine.cls.setup import RUN_GROUPS
from visattn.engine.cls.trainer import run_cls
from visattn.engine.launch import launched_rank, prepare_entry_point, reported_failures
from visattn.engine.training_run import adopt_training_config

log = logging.getLogger(__name__)


@hydra.main(version_base="1.3", config_path="conf", config_name="train_cls")
def main(cfg: DictConfig) -> float:
    with reported_failures():  # a failure is in the run's log; a stop with its state saved exits 75
        cfg = adopt_training_config(cfg, RUN_GROUPS, HydraConfig.get().overrides.task, modes=("eval",))
        results = run_cls(cfg, HydraConfig.get().runtime.output_dir)
    if launched_rank() == 0:
        summary = {k: results.get(k) for k in ("top1", "top5", "top1_best", "active_ratio", "run_dir")}
        print(json.dumps(summary))
    return results["top1"]


if __name__ == "__main__":
    prepare_entry_point(sys.argv)
    main()
