"""Scoring generated images against a reference batch: FID, sFID, IS, precision and recall.

``GenerationScorer`` holds one extractor and the reference's features, so a training loop pays
for the extractor and the reference once and then only for its samples:

    scorer = GenerationScorer(build_extractor("digits"))
    reference = scorer.reference_stats("ref.npz")      # or a ReferenceBatch / uint8 images
    scorer.score(samples_uint8, reference)              # {"fid", "sfid", "is", "precision", "recall", ...}
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .extractor import FeatureExtractor, build_extractor, check_images
from .fid import feature_statistics, frechet_distance
from .inception_score import ADM_SPLIT_SIZE, inception_score
from .precision_recall import DEFAULT_BATCH_SIZE, precision_recall
from .reference import ReferenceBatch, load_npz_batch

logger = logging.getLogger(__name__)

ADM_STATISTICS_EXTRACTOR = "inception"  # ADM's own reference files carry no extractor name


@dataclass(frozen=True)
class ReferenceStats:
    """What scoring needs of a reference batch, for one extractor."""

    extractor: str
    pooled: np.ndarray  # [N, D] features of the reference images (precision/recall)
    mu: np.ndarray  # [D]
    sigma: np.ndarray  # [D, D]
    mu_s: np.ndarray  # [S]
    sigma_s: np.ndarray  # [S, S]

    @property
    def num_images(self) -> int:
        return len(self.pooled)


class GenerationScorer:
    """Scores uint8 samples ``[N, H, W, C]`` with one extractor, reused across evaluations."""

    def __init__(
        self,
        extractor: FeatureExtractor,
        batch_size: int = 64,
        k: int = 3,
        is_split_size: int = ADM_SPLIT_SIZE,
        distance_batch_size: int = DEFAULT_BATCH_SIZE,
        progress: bool = False,
    ):
        self.extractor = extractor
        self.batch_size = batch_size
        self.k = k
        self.is_split_size = is_split_size
        self.distance_batch_size = distance_batch_size
        self.progress = progress

    def reference_stats(self, reference: ReferenceBatch | ReferenceStats | str | Path | np.ndarray) -> ReferenceStats:
        """Features of the reference images; its stored statistics are used when this extractor made them."""
        if isinstance(reference, ReferenceStats):
            if reference.extractor != self.extractor.name:
                raise ValueError(
                    f"reference statistics come from the {reference.extractor!r} extractor, "
                    f"this scorer uses {self.extractor.name!r}; recompute them with this scorer"
                )
            return reference
        if isinstance(reference, (str, Path)):
            reference = load_npz_batch(reference)
        elif isinstance(reference, np.ndarray):
            reference = ReferenceBatch(images=check_images(reference, "reference images"))
        features = self.extractor.extract(reference.images, self.batch_size, self.progress)
        mu, sigma = feature_statistics(features.pooled)
        mu_s, sigma_s = feature_statistics(features.spatial)
        if reference.has_statistics:
            made_by = reference.extractor or ADM_STATISTICS_EXTRACTOR
            if made_by == self.extractor.name and reference.mu.shape == mu.shape and reference.mu_s.shape == mu_s.shape:
                mu, sigma, mu_s, sigma_s = reference.mu, reference.sigma, reference.mu_s, reference.sigma_s
            else:
                logger.warning(
                    "reference statistics were made by the %r extractor; recomputing them from its %d images with %r",
                    made_by, len(features), self.extractor.name,
                )
        return ReferenceStats(self.extractor.name, features.pooled, mu, sigma, mu_s, sigma_s)

    def score(
        self, samples: np.ndarray, reference: ReferenceBatch | ReferenceStats | str | Path | np.ndarray
    ) -> dict[str, Any]:
        """``{"fid", "sfid", "is", "precision", "recall", "extractor", "num_samples", "num_reference"}``."""
        reference = self.reference_stats(reference)
        features = self.extractor.extract(check_images(samples, "samples"), self.batch_size, self.progress)
        mu, sigma = feature_statistics(features.pooled)
        mu_s, sigma_s = feature_statistics(features.spatial)
        precision, recall = precision_recall(
            reference.pooled, features.pooled, k=self.k, batch_size=self.distance_batch_size,
            device=self.extractor.device,
        )
        return {
            "fid": frechet_distance(mu, sigma, reference.mu, reference.sigma),
            "sfid": frechet_distance(mu_s, sigma_s, reference.mu_s, reference.sigma_s),
            "is": inception_score(features.logits, split_size=self.is_split_size),
            "precision": precision,
            "recall": recall,
            "extractor": self.extractor.name,
            "num_samples": len(features),
            "num_reference": reference.num_images,
        }


def compute_generation_metrics(
    samples: np.ndarray | str | Path,
    reference: ReferenceBatch | str | Path | np.ndarray,
    extractor: str | FeatureExtractor = "inception",
    weights: str | Path | None = None,
    device: str | torch.device = "cpu",
    **scorer_kwargs: Any,
) -> dict[str, Any]:
    """One-shot scoring (``samples``: uint8 ``[N, H, W, C]`` or an ADM ``.npz``); builds the extractor
    by name unless one is given. Loops that score repeatedly should keep a ``GenerationScorer``."""
    if isinstance(extractor, str):
        extractor = build_extractor(extractor, weights=weights, device=device)
    if isinstance(samples, (str, Path)):
        samples = load_npz_batch(samples).images
    return GenerationScorer(extractor, **scorer_kwargs).score(samples, reference)
