"""DiT entry: validate the resolved config (``dit_setup``), launch (``launch``), run the mode.

Modes: ``train`` (AdamW at a constant lr, EMA of the weights, hybrid diffusion loss + beta * MoH
load-balancing loss, DDP under torchrun, atomic resumable checkpoints, then sample and score with
the EMA model), ``sample`` (N images with one seed per sample index -> ``samples.npz`` + grid PNG),
``eval`` (sample + score -> ``results.json``) and ``cache_latents`` (pre-encode a dataset with the
SD VAE). Pixel-space runs (``vae=none``) work on in-memory images in [-1, 1]; latent runs read the
latent cache (``data.latents``). One module per job: dit_setup (config), dit_data, dit_train (the
loop), dit_eval (sampling + scores, sample / eval modes), dit_latents (cache_latents).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from visattn.engine.dit_eval import eval_mode, sample_mode
from visattn.engine.dit_latents import cache_latents_mode
from visattn.engine.dit_setup import validate_dit_config
from visattn.engine.dit_train import train
from visattn.engine.guard import NonFiniteError
from visattn.engine.launch import launched
from visattn.engine.preempt import Preempted
from visattn.engine.results import peak_memory_mb, write_results

__all__ = ["MODES", "run"]

MODES = {"train": train, "sample": sample_mode, "eval": eval_mode, "cache_latents": cache_latents_mode}


def run(cfg: Mapping[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """Run ``cfg.mode`` through the launch layer; rank 0 writes results.json (train / eval) and the
    results are returned. A preempted training raises ``Preempted`` and a diverged one
    ``NonFiniteError``, after writing results.json with ``completed: false`` and why."""
    cfg = validate_dit_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    mode = cfg["mode"]
    with launched(cfg["device"], cfg["train"].get("num_threads"), run_dir) as ctx:
        dist, run_dir = ctx.dist, ctx.run_dir
        start = time.perf_counter()

        def finish(results: dict[str, Any]) -> dict[str, Any]:
            if dist.is_main and mode in ("train", "eval"):
                results.update({"wall_time_s": time.perf_counter() - start,
                                "peak_memory_mb": peak_memory_mb(dist.device), "config": dict(cfg)})
                write_results(run_dir, results)
            return results

        try:
            results = MODES[mode](cfg, dist, run_dir, ctx.stop) if mode == "train" else MODES[mode](cfg, dist, run_dir)
        except Preempted as stopped:
            finish({"task": "dit", "completed": False, "preempted": True, "train_steps": stopped.step})
            raise
        except NonFiniteError as err:
            finish({"task": "dit", "completed": False, "failure": err.failure})
            raise
        return finish({**results, "completed": True} if mode == "train" else results)
