"""DiT data: in-memory pixel arrays or the latent cache, the per-rank batch stream, the decoder from
model space to images, and the image source of the latent cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from visattn.data.latents import PixelData, pad_to, read_latent_cache
from visattn.data.loaders import train_sampler
from visattn.data.registry import array_dataset_names, is_array_dataset, load_arrays
from visattn.engine.distributed import (
    DistInfo,
)
from visattn.engine.dit.setup import pixel_canvas, uses_vae

log = logging.getLogger(__name__)


def load_pixel_arrays(cfg: Mapping[str, Any], split: str) -> tuple[np.ndarray, np.ndarray]:
    data = cfg["data"]
    if not is_array_dataset(data["name"]):
        raise ValueError(
            f"data={data['name']} has no in-memory pixel loader for DiT; use one of {array_dataset_names()} in pixel "
            f"space, or vae=sd with a latent cache (mode=cache_latents)"
        )
    return load_arrays(data["name"], split, data.get("root"))


def build_train_data(cfg: Mapping[str, Any]):
    flip = bool(cfg["train"]["flip"])
    if uses_vae(cfg):
        path = cfg["data"].get("latents")
        if not path:
            raise ValueError(
                "vae=sd trains on a latent cache: set data.latents=DIR (create it with "
                "`python train_dit.py mode=cache_latents vae=sd data=... data.latents=DIR`)"
            )
        return read_latent_cache(path, flip=flip)
    images, labels = load_pixel_arrays(cfg, "train")
    return PixelData(pad_to(images, pixel_canvas(cfg)), labels, flip=flip)


def build_codec(cfg: Mapping[str, Any], device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Model space [B, C, h, w] -> images in [-1, 1] [B, C, H, W] at the data's size."""
    if uses_vae(cfg):
        from visattn.models.vae import load_sd_vae

        vae = cfg["vae"]
        codec = load_sd_vae(vae.get("path"), vae["repo"], float(vae["scale"]), device=device)
        return codec.decode
    size = int(cfg["data"]["image_size"])

    def crop(x: torch.Tensor) -> torch.Tensor:
        top = (x.shape[-1] - size) // 2
        return x[..., top : top + size, top : top + size]

    return crop


def to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch built in the main process, on ``device``. On CUDA through pinned memory, so that the
    copy is asynchronous (``non_blocking`` from pageable memory is not) and overlaps the device's
    work on the step before (DiT's train.py pins its loader's batches too)."""
    if device.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


class EpochBatches:
    """This rank's batches of indices: a shuffled shard per epoch (deterministic in seed and epoch),
    last partial batch dropped. ``epoch`` and ``taken`` (batches of that epoch already used) are
    checkpointed, so a resumed run continues the same stream."""

    def __init__(self, size: int, batch_size: int, dist: DistInfo, seed: int) -> None:
        self.sampler = train_sampler(range(size), dist.rank, dist.world_size, seed)
        self.batch_size = batch_size
        if len(self.sampler) < batch_size:
            raise ValueError(
                f"per-rank batch {batch_size} is larger than this rank's share of the data ({len(self.sampler)}); "
                f"lower train.batch_size"
            )
        self.epoch = 0
        self.taken = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.sampler.set_epoch(self.epoch)
            order = torch.tensor(list(self.sampler), dtype=torch.long)
            n_batches = len(order) // self.batch_size
            while self.taken < n_batches:
                start = self.taken * self.batch_size
                self.taken += 1
                yield order[start : start + self.batch_size]
            self.epoch += 1
            self.taken = 0


class ImageSource:
    """The training images of the latent cache: ``take(a, b)`` -> (uint8 images [b - a, S, S, C], int64
    labels [b - a]), each label that of the image returned (a folder under ``data.bad_images=skip`` fills
    a bad file's slot with the next good file, and its class); ``skipped_files()`` lists what was left out."""

    def __init__(self, size: int, take: Callable[[int, int], tuple[np.ndarray, np.ndarray]],
                 skipped: Callable[[], list[dict[str, str]]] = list) -> None:
        self.size, self.take, self.skipped_files = size, take, skipped

    def __len__(self) -> int:
        return self.size


def image_source(cfg: Mapping[str, Any]) -> ImageSource:
    """Training images at data.image_size for the latent cache: embedded datasets centre-padded; an
    ImageNet-style folder through ADM's centre crop."""
    data = cfg["data"]
    size = int(data["image_size"])
    if data["name"] == "imagefolder":
        from visattn.data.datasets import build_imagefolder_split
        from visattn.data.images import skipped_files
        from visattn.metrics import center_crop_arr

        root = data.get("root")
        if root is None or not (Path(root) / "train").is_dir():
            raise FileNotFoundError(
                f"data.root={root}: no folder train/ there; mode=cache_latents with data=imagefolder encodes "
                f"ROOT/train/<class>/*.jpeg (ImageNet layout), so point data.root at ROOT"
            )
        # data.bad_images / data.verify_train apply; the loader hands over RGB images
        folder = build_imagefolder_split(data, "train", lambda im: center_crop_arr(im, size))

        def take(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
            items = [folder[i] for i in range(start, min(stop, len(folder)))]
            return np.stack([image for image, _ in items]), np.asarray([label for _, label in items], dtype=np.int64)

        return ImageSource(len(folder), take, lambda: skipped_files(folder))
    images, labels = load_pixel_arrays(cfg, "train")
    images = pad_to(images, size)
    return ImageSource(len(labels), lambda start, stop: (images[start:stop], labels[start:stop]))
