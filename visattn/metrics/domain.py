"""Domain feature extractors for the embedded datasets: a small CNN classifier trained by our code.

Inception features mean little on 8x8 digits or 28x28 clothes, so generation on those datasets is
scored with a classifier trained on the dataset's training split. It offers the same outputs as the
Inception extractor: pooled features of its last conv stage (FID, precision/recall), the first
``spatial_channels`` channels of its mid-level map flattened channels-last (sFID) and logits (IS).
Training is seeded and runs once; the weights are cached at
``${VISATTN_CACHE:-~/.cache/visattn}/extractors/<name>-<hash of recipe>.safetensors``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes
from torch import nn

from visattn.data.registry import load_arrays
from visattn.utils.checkpoint import atomic_write_bytes, load_weights

from .extractor_base import FeatureExtractor

logger = logging.getLogger(__name__)

ARCHITECTURE_VERSION = 1  # bump when DomainCNN changes, so cached weights of the old one are not reused
NUM_CLASSES = 10


@dataclass(frozen=True)
class DomainRecipe:
    """Everything that determines the trained weights; its digest names the cache file."""

    dataset: str
    image_size: int  # native side length; inputs of other sizes are resized to it
    widths: tuple[int, int, int]  # channels of the stem, mid and top conv stages
    spatial_channels: int  # mid-level channels kept for sFID
    epochs: int
    batch_size: int
    lr: float
    weight_decay: float
    seed: int = 0

    def digest(self) -> str:
        text = json.dumps({**asdict(self), "architecture": ARCHITECTURE_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


DOMAIN_RECIPES = {
    # digits: 4x4 mid map x 16 channels = 256-d spatial features; fashion: 14x14 x 8 = 1568-d.
    "digits": DomainRecipe("digits", 8, (16, 32, 64), 16, epochs=15, batch_size=64, lr=3e-3, weight_decay=1e-4),
    "fashion_mnist": DomainRecipe(
        "fashion_mnist", 28, (16, 32, 64), 8, epochs=2, batch_size=128, lr=3e-3, weight_decay=1e-4
    ),
}


def _conv_bn_relu(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    )


class DomainCNN(nn.Module):
    """``x: [B, 1, S, S]`` -> ``(pooled [B, w2], mid map [B, w1, S/2, S/2], logits [B, classes])``."""

    def __init__(self, image_size: int, widths: tuple[int, int, int], num_classes: int = NUM_CLASSES):
        super().__init__()
        stem, mid, top = widths
        self.stem = _conv_bn_relu(1, stem)
        self.mid = _conv_bn_relu(stem, mid)
        # A second pooling only where the map is still large (28 -> 14 -> 7; 8 stays at 4).
        self.top = nn.Sequential(nn.MaxPool2d(2) if image_size // 2 >= 8 else nn.Identity(), _conv_bn_relu(mid, top))
        self.head = nn.Linear(top, num_classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mid_map = self.mid(F.max_pool2d(self.stem(x), 2))
        pooled = self.top(mid_map).mean(dim=(2, 3))
        return pooled, mid_map, self.head(pooled)


class DomainExtractor(FeatureExtractor):
    """``forward(images: uint8 [B, H, W, C])`` -> ``(pooled [B, w2], spatial [B, S], logits [B, 10])``."""

    def __init__(self, recipe: DomainRecipe):
        super().__init__()
        self.name = recipe.dataset
        self.recipe = recipe
        self.net = DomainCNN(recipe.image_size, recipe.widths)
        self.register_buffer("pixel_mean", torch.tensor(0.0))
        self.register_buffer("pixel_std", torch.tensor(1.0))
        self.test_accuracy: float | None = None

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, H, W, C]`` -> standardised grey ``[B, 1, S, S]`` at the native size."""
        x = images.permute(0, 3, 1, 2).float().div(255.0)
        if x.shape[1] == 3:
            x = x.mean(dim=1, keepdim=True)
        size = self.recipe.image_size
        if x.shape[-2:] != (size, size):
            x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        return (x - self.pixel_mean) / self.pixel_std

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pooled, mid_map, logits = self.net(self.preprocess(images))
        spatial = mid_map[:, : self.recipe.spatial_channels].permute(0, 2, 3, 1).flatten(1)
        return pooled, spatial, logits


def cache_root(cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir or os.environ.get("VISATTN_CACHE") or "~/.cache/visattn").expanduser()


def domain_extractor_path(name: str, cache_dir: str | Path | None = None) -> Path:
    return cache_root(cache_dir) / "extractors" / f"{name}-{_recipe(name).digest()}.safetensors"


def _recipe(name: str) -> DomainRecipe:
    if name not in DOMAIN_RECIPES:
        raise ValueError(f"no domain extractor recipe for {name!r}; use one of {', '.join(DOMAIN_RECIPES)}")
    return DOMAIN_RECIPES[name]


@torch.inference_mode()
def classification_accuracy(extractor: DomainExtractor, images: np.ndarray, labels: np.ndarray) -> float:
    logits = extractor.extract(images, batch_size=512).logits
    return float((logits.argmax(axis=1) == labels).mean())


@contextmanager
def _one_thread() -> Iterator[None]:
    # Convolutions this small lose more to thread hand-offs than they gain (7x slower on two busy
    # cores), and one thread fixes the order of reductions: the weights do not depend on the machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def train_domain_extractor(recipe: DomainRecipe, root: str | Path | None = None) -> DomainExtractor:
    """Train on the dataset's training split (seeded, one thread); sets ``test_accuracy`` on the test split."""
    with _one_thread():
        return _train(recipe, root)


def _train(recipe: DomainRecipe, root: str | Path | None) -> DomainExtractor:
    images, labels = load_arrays(recipe.dataset, "train", root)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        extractor = DomainExtractor(recipe)
    histogram = np.bincount(images.ravel(), minlength=256) / images.size  # exact moments, no float copy
    levels = np.arange(256) / 255.0
    mean = float(histogram @ levels)
    extractor.pixel_mean.fill_(mean)
    extractor.pixel_std.fill_(float(np.sqrt(histogram @ (levels - mean) ** 2)))

    generator = torch.Generator().manual_seed(recipe.seed)
    steps_per_epoch = -(-len(images) // recipe.batch_size)
    optimizer = torch.optim.AdamW(extractor.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=recipe.lr, total_steps=recipe.epochs * steps_per_epoch
    )
    images_t, labels_t = torch.tensor(images), torch.tensor(labels)
    extractor.train()
    for epoch in range(recipe.epochs):
        order = torch.randperm(len(images), generator=generator)
        total = 0.0
        for start in range(0, len(images), recipe.batch_size):
            idx = order[start : start + recipe.batch_size]
            loss = F.cross_entropy(extractor(images_t[idx])[2], labels_t[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.item() * len(idx)
        logger.debug("%s extractor epoch %d: loss %.4f", recipe.dataset, epoch, total / len(images))
    extractor.eval()
    test_images, test_labels = load_arrays(recipe.dataset, "test", root)
    extractor.test_accuracy = classification_accuracy(extractor, test_images, test_labels)
    return extractor


def save_domain_extractor(path: str | Path, extractor: DomainExtractor) -> None:
    tensors = {k: v.detach().cpu().contiguous() for k, v in extractor.state_dict().items()}
    metadata = {"recipe": json.dumps(asdict(extractor.recipe)), "test_accuracy": repr(extractor.test_accuracy)}
    atomic_write_bytes(path, safetensors_bytes(tensors, metadata=metadata))


def load_domain_extractor(
    name: str, weights: str | Path | None = None, cache_dir: str | Path | None = None, root: str | Path | None = None
) -> DomainExtractor:
    """The trained extractor from ``weights`` or the cache; trains it (and caches it) on first use."""
    recipe = _recipe(name)
    path = Path(weights) if weights else domain_extractor_path(name, cache_dir)
    if weights and not path.is_file():
        raise FileNotFoundError(f"{name} extractor weights {path} do not exist; omit --weights to train and cache them")
    if path.is_file():
        extractor = DomainExtractor(recipe)
        try:
            extractor.load_state_dict(load_weights(path))
        except Exception as err:  # a truncated / foreign file: name it and what it should hold
            raise ValueError(
                f"{name} extractor weights {path} could not be loaded ({type(err).__name__}: {err}); expected a "
                f"safetensors file of the {name} DomainCNN (delete it to retrain, or omit --weights)"
            ) from err
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                accuracy = (f.metadata() or {}).get("test_accuracy")
            extractor.test_accuracy = float(accuracy) if accuracy not in (None, "None") else None
        return extractor.eval()
    logger.info("training the %s feature extractor on first use (recipe %s), caching it at %s", name, recipe, path)
    extractor = train_domain_extractor(recipe, root)
    logger.info("%s feature extractor: test accuracy %.4f", name, extractor.test_accuracy)
    save_domain_extractor(path, extractor)
    return extractor
