"""DiT entry: validate the resolved config (``setup``), launch (``engine.launch``), run the mode.

Modes: ``train`` (AdamW at a constant lr, EMA of the weights, hybrid diffusion loss + beta * MoH
load-balancing loss, DDP under torchrun, atomic resumable checkpoints, then sample and score with
the EMA model), ``sample`` (N images with one seed per sample index -> ``samples.npz`` + grid PNG),
``eval`` (sample + score -> ``results.json``) and ``cache_latents`` (pre-encode a dataset with the
SD VAE). Pixel-space runs (``vae=none``) work on in-memory images in [-1, 1]; latent runs read the
latent cache (``data.latents``). One module per job in this package: setup (config), data, training
(the loop), sampling, evaluation (scores, sample / eval modes), latents (cache_latents).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from visattn.engine.dit.evaluation import eval_mode, sample_mode
from visattn.engine.dit.latents import cache_latents_mode
from visattn.engine.dit.setup import validate_dit_config
from visattn.engine.dit.training import train
from visattn.engine.guard import NonFiniteError
from visattn.engine.launch import launched
from visattn.engine.preempt import Preempted
from visattn.engine.results import RunClock, peak_memory_mb, write_results
from visattn.engine.training_run import refuse_to_overwrite_training

__all__ = ["MODES", "run"]

MODES = {"train": train, "sample": sample_mode, "eval": eval_mode, "cache_latents": cache_latents_mode}


def run(cfg: Mapping[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """Run ``cfg.mode`` through the launch layer; rank 0 writes results.json (every mode, with its
    ``mode``) and the results are returned. A preempted training raises ``Preempted`` and a diverged one
    ``NonFiniteError``, after writing results.json with ``completed: false`` and why."""
    cfg = validate_dit_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    mode = cfg["mode"]
    refuse_to_overwrite_training(Path(run_dir), mode)
    with launched(cfg["device"], cfg["train"].get("num_threads"), run_dir, dict(cfg)) as ctx:
        dist, run_dir = ctx.dist, ctx.run_dir
        clock = RunClock()  # training: every process of the run (train keeps it in the checkpoints)

        def finish(results: dict[str, Any]) -> dict[str, Any]:
            if dist.is_main:
                results.setdefault("task", "dit")
                results.update({"mode": mode, "world_size": dist.world_size, **ctx.resume_notes, **clock.record(dist.device),
                                "peak_memory_mb": peak_memory_mb(dist.device), "config": dict(cfg)})
                write_results(run_dir, results)
            return results

        try:
            results = MODES[mode](cfg, dist, run_dir, ctx.stop, clock) if mode == "train" else \
                MODES[mode](cfg, dist, run_dir, ctx.stop)
        except Preempted as stopped:
            finish({"task": "dit", "completed": False, "preempted": True, "train_steps": stopped.step})
            raise
        except NonFiniteError as err:
            finish({"task": "dit", "completed": False, "failure": err.failure})
            raise
        return finish({**results, "completed": True} if mode == "train" else results)
