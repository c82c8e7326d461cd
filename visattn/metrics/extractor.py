"""The interface every feature extractor offers to the metrics, and the factory that builds one by name.

An extractor takes uint8 images ``[N, H, W, C]`` (the ADM ``.npz`` layout, C = 1 or 3), resizes and
normalises them itself, and returns per image: pooled features (FID, precision/recall), a spatial
feature map flattened channels-last (sFID) and classifier logits (IS).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from visattn.data import array_dataset_names, domain_extractor


def extractor_names() -> tuple[str, ...]:
    """``inception`` and the domain classifiers that registered array datasets name."""
    domain = {domain_extractor(name) for name in array_dataset_names()} - {None}
    return ("inception", *sorted(domain))


EXTRACTOR_NAMES = extractor_names()  # the registry's built-in datasets (visattn/data/sets)


@dataclass(frozen=True)
class Features:
    """float32 arrays, one row per image."""

    pooled: np.ndarray  # [N, D]
    spatial: np.ndarray  # [N, S]
    logits: np.ndarray  # [N, K]

    def __len__(self) -> int:
        return len(self.pooled)


def check_images(images: np.ndarray, what: str = "images") -> np.ndarray:
    """Validate the ADM layout: a uint8 numpy array ``[N, H, W, C]`` with C in (1, 3)."""
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8:
        kind = images.dtype if isinstance(images, np.ndarray) else type(images).__name__
        raise ValueError(f"{what} must be a uint8 numpy array [N, H, W, C] (values 0..255); got {kind}")
    if images.ndim != 4 or images.shape[-1] not in (1, 3) or len(images) == 0:
        raise ValueError(f"{what} must be [N, H, W, C] with N >= 1 and C = 1 or 3 (channels last); got {images.shape}")
    return images


class FeatureExtractor(nn.Module, ABC):
    """Base class: subclasses set ``name`` and implement ``forward`` on one batch."""

    name: str

    @abstractmethod
    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``images: uint8 [B, H, W, C]`` -> ``(pooled [B, D], spatial [B, S], logits [B, K])``."""

    @property
    def device(self) -> torch.device:
        tensor = next(itertools.chain(self.parameters(), self.buffers()), None)
        return tensor.device if tensor is not None else torch.device("cpu")

    @torch.inference_mode()
    def extract(self, images: np.ndarray, batch_size: int = 64, progress: bool = False) -> Features:
        """Features of ``images: uint8 [N, H, W, C]``, in batches on the extractor's device."""
        check_images(images)
        self.eval()
        outputs: list[tuple[np.ndarray, ...]] = []
        for start in tqdm(range(0, len(images), batch_size), desc=f"{self.name} features", disable=not progress):
            batch = torch.tensor(images[start : start + batch_size], device=self.device)
            outputs.append(tuple(t.float().cpu().numpy() for t in self(batch)))
        pooled, spatial, logits = (np.concatenate(parts) for parts in zip(*outputs, strict=True))
        return Features(pooled=pooled, spatial=spatial, logits=logits)


def build_extractor(
    name: str,
    weights: str | Path | None = None,
    device: str | torch.device = "cpu",
    cache_dir: str | Path | None = None,
    data_root: str | Path | None = None,
) -> FeatureExtractor:
    """``inception`` (torch-fidelity's port; ``weights`` = its local weights file) or a domain
    classifier ``digits`` / ``fashion_mnist`` (``weights`` = a trained file; else trained once on
    the dataset found at ``data_root`` and cached under ``cache_dir``)."""
    if name == "inception":
        from .inception import InceptionExtractor

        extractor: FeatureExtractor = InceptionExtractor(weights)
    elif name in extractor_names():
        from .domain import load_domain_extractor

        extractor = load_domain_extractor(name, weights=weights, cache_dir=cache_dir, root=data_root)
    else:
        raise ValueError(f"extractor {name!r} is not known; use one of {', '.join(EXTRACTOR_NAMES)}")
    return extractor.to(device).eval()
