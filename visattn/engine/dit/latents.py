"""``mode=cache_latents``: encode the training split with the SD VAE into ``data.latents``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from visattn.engine.distributed import (
    DistInfo,
)
from visattn.engine.dit.data import image_source
from visattn.engine.preempt import StopSignal, stop_checked

log = logging.getLogger(__name__)


def cache_latents_mode(cfg: Mapping[str, Any], dist: DistInfo, run_dir: Path,
                       stop: StopSignal | None = None) -> dict[str, Any]:
    """Encode the training split with the SD VAE into ``data.latents`` (single process). A stop signal
    ends it after the current batch (``Preempted``; run it again to encode afresh)."""
    from visattn.data.latents import to_unit_range, write_latent_cache
    from visattn.models.vae import load_sd_vae

    out = cfg["data"].get("latents")
    if not out:
        raise ValueError("mode=cache_latents needs data.latents=DIR (where the shards go)")
    source = image_source(cfg)  # before the VAE: a wrong data.root should fail in seconds, not after a load
    vae_cfg = cfg["vae"]
    vae = load_sd_vae(vae_cfg.get("path"), vae_cfg["repo"], float(vae_cfg["scale"]), device=dist.device)
    rgb = vae.autoencoder.config.in_channels == 3
    count = min(len(source), int(cfg["cache"].get("max_images") or len(source)))
    batch = int(cfg["cache"]["batch_size"])

    def batches():
        starts = stop_checked(range(0, count, batch), stop, 0, dist.device)
        for start in tqdm(starts, total=-(-count // batch), desc="encoding"):
            images, labels = source.take(start, min(start + batch, count))
            x = to_unit_range(torch.from_numpy(np.ascontiguousarray(images)))
            if rgb and x.shape[1] == 1:
                x = x.expand(-1, 3, -1, -1)
            yield x.to(dist.device), torch.from_numpy(np.asarray(labels))

    meta = {"data": cfg["data"]["name"], "image_size": int(cfg["data"]["image_size"])}
    paths = write_latent_cache(out, batches(), vae.encode_moments, vae.scale, int(cfg["cache"]["shard_size"]), meta)
    return {"latents": str(out), "shards": len(paths), "images": count, "skipped_files": source.skipped_files()}
