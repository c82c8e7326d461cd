"""The interface every feature extractor offers to the metrics: ``FeatureExtractor`` and its ``Features``.

An extractor takes uint8 images ``[N, H, W, C]`` (the ADM ``.npz`` layout, C = 1 or 3), resizes and
normalises them itself, and returns per image: pooled features (FID, precision/recall), a spatial
feature map flattened channels-last (sFID) and classifier logits (IS). The extractors themselves
(``inception``, ``domain``) build on this module; the factory that picks one by name is ``extractor``.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm


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
