"""DiT training data held in memory: pixel images, or VAE latents pre-encoded into shard files.

The latent cache is a folder of safetensors shards ``latents-00000.safetensors`` ... each holding
``mean`` and ``std`` float16 ``[n, 2, C, h, w]`` (the unscaled VAE posterior of the image, index 0,
and of its horizontal flip, index 1) and ``labels`` int64 ``[n]``, plus ``meta.json``. Training
draws a flip and a posterior sample per example and step, so the VAE never runs in the loop.

Both sources give batches ``x: [B, C, H, W]`` float32 and ``y: [B]`` int64 through ``batch(indices)``;
randomness (flips, posterior noise) comes from the global torch RNG, which checkpoints restore.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save

from visattn.utils.checkpoint import atomic_write_bytes

SHARD_PATTERN = "latents-{:05d}.safetensors"
META_FILE = "meta.json"


def pad_to(images: np.ndarray, size: int) -> np.ndarray:
    """uint8 [N, H, W, C] centred on a zero canvas [N, size, size, C] (Fashion-MNIST 28 -> 32)."""
    n, h, w, c = images.shape
    if h == w == size:
        return images
    if h > size or w > size or (size - h) % 2 or (size - w) % 2:
        raise ValueError(
            f"images of {h}x{w} cannot be centre-padded to {size}x{size}; use a side >= {max(h, w)} "
            f"that differs from the image side by an even number (dit.image_size / data.image_size)"
        )
    out = np.zeros((n, size, size, c), dtype=images.dtype)
    top, left = (size - h) // 2, (size - w) // 2
    out[:, top : top + h, left : left + w] = images
    return out


def to_unit_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, C] -> float32 [B, C, H, W] in [-1, 1]."""
    return images.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def to_uint8(x: torch.Tensor) -> np.ndarray:
    """float [B, C, H, W] in [-1, 1] -> uint8 [B, H, W, C] (the ADM .npz layout)."""
    return ((x.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def random_flip(x: torch.Tensor) -> torch.Tensor:
    """Flip each image of [B, C, H, W] horizontally with probability 1/2."""
    flip = torch.rand(x.shape[0]) < 0.5
    return torch.where(flip.view(-1, 1, 1, 1).to(x.device), x.flip(-1), x)


class PixelData:
    """uint8 images [N, H, W, C] and labels [N]; batches in [-1, 1] with random horizontal flips."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, flip: bool = True) -> None:
        if images.dtype != np.uint8 or images.ndim != 4 or len(images) != len(labels):
            raise ValueError(f"images must be uint8 [N, H, W, C] with one label each; got {images.shape}, {labels.shape}")
        # a read-only array (a memory map, a cached dataset) is copied: torch warns that sharing it is unsafe
        self.images = torch.from_numpy(np.require(images, requirements=["C", "W"]))
        self.labels = torch.from_numpy(np.require(labels, dtype=np.int64, requirements=["C", "W"]))
        self.flip = flip

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        _, h, w, c = self.images.shape
        return (c, h, w)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = to_unit_range(self.images[indices])
        return (random_flip(x) if self.flip else x), self.labels[indices]


class LatentData:
    """A latent cache in memory; a batch is ``(mean + std * noise) * scale`` of a random flip."""

    def __init__(self, mean: torch.Tensor, std: torch.Tensor, labels: torch.Tensor, scale: float, flip: bool = True):
        self.mean, self.std, self.labels = mean, std, labels
        self.scale = scale
        self.flip = flip

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return tuple(self.mean.shape[2:])

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        view = torch.randint(0, 2, (len(indices),)) if self.flip else torch.zeros(len(indices), dtype=torch.long)
        mean = self.mean[indices, view].float()
        std = self.std[indices, view].float()
        return (mean + std * torch.randn_like(mean)) * self.scale, self.labels[indices]


def write_latent_cache(
    out_dir: str | Path,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    encode,
    scale: float,
    shard_size: int = 50_000,
    meta: dict | None = None,
) -> list[Path]:
    """Encode image batches into shards of ``shard_size`` examples (the last may be smaller). ``batches`` yields (images [B, C, H, W] in [-1, 1], labels [B]);
    ``encode(images) -> (mean, std)``. Returns the shard paths; each file is written atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pending: dict[str, list[torch.Tensor]] = {"mean": [], "std": [], "labels": []}
    paths: list[Path] = []

    def write(count: int) -> None:
        """Write the first ``count`` pending examples as the next shard."""
        tensors = {k: torch.cat(v) for k, v in pending.items()}
        path = out_dir / SHARD_PATTERN.format(len(paths))
        atomic_write_bytes(path, save({k: v[:count].contiguous() for k, v in tensors.items()}))
        paths.append(path)
        for k, v in tensors.items():
            pending[k] = [v[count:]] if len(v) > count else []

    for images, labels in batches:
        views = [encode(images), encode(images.flip(-1))]
        pending["mean"].append(torch.stack([v[0] for v in views], dim=1).half().cpu())
        pending["std"].append(torch.stack([v[1] for v in views], dim=1).half().cpu())
        pending["labels"].append(labels.long().cpu())
        while sum(len(v) for v in pending["labels"]) >= shard_size:
            write(shard_size)
    remaining = sum(len(v) for v in pending["labels"])
    if remaining:
        write(remaining)
    if not paths:
        raise ValueError("no images to encode: the dataset is empty")
    info = {"scale": scale, "shards": [p.name for p in paths], **(meta or {})}
    atomic_write_bytes(out_dir / META_FILE, json.dumps(info, indent=2).encode())
    return paths


def read_latent_cache(cache_dir: str | Path, flip: bool = True) -> LatentData:
    """Load every shard of a cache folder written by ``write_latent_cache``."""
    cache_dir = Path(cache_dir)
    meta_path = cache_dir / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"data.latents={cache_dir} has no {META_FILE}; create the cache first with "
            f"`python train_dit.py mode=cache_latents data=... vae=sd data.latents={cache_dir}`"
        )
    meta = json.loads(meta_path.read_text())
    shards = [load_file(cache_dir / name) for name in meta["shards"]]
    mean, std, labels = (torch.cat([s[k] for s in shards]) for k in ("mean", "std", "labels"))
    return LatentData(mean, std, labels, float(meta["scale"]), flip)
