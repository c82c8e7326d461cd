"""Scoring generated images against a reference batch: FID, sFID, IS, precision and recall.

``GenerationScorer`` holds one extractor and the reference's features, so a training loop pays
for the extractor and the reference once and then only for its samples:

    scorer = GenerationScorer(build_extractor("digits"))
    reference = scorer.reference_stats("ref.npz")      # or a ReferenceBatch / uint8 images
    scorer.score(samples_uint8, reference, labels=y)    # {"fid", "sfid", "is", "precision", "recall",
                                                        #  "class_agreement", ...}

sFID is reported only where both sample sets are large enough for a covariance of its dimension
(``SFID_SAMPLES_PER_DIM``); otherwise ``sfid`` is None and ``sfid_note`` says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .agreement import LABEL_EXTRACTORS, class_agreement
from .extractor import build_extractor
from .extractor_base import FeatureExtractor, check_images
from .fid import feature_statistics, frechet_distance
from .inception_score import ADM_SPLIT_SIZE, inception_score
from .precision_recall import DEFAULT_BATCH_SIZE, precision_recall
from .reference import ReferenceBatch, load_npz_batch, load_samples

logger = logging.getLogger(__name__)

ADM_STATISTICS_EXTRACTOR = "inception"  # ADM's own reference files carry no extractor name
# sFID needs both sample sets to hold at least this many images per spatial feature dimension: below
# it the [S, S] covariance is rank-deficient or noisy enough that two draws of one distribution sit
# far apart (Inception's 2,023-d features need 20,230 images; ADM's FID-50K has 50,000).
SFID_SAMPLES_PER_DIM = 10


def sfid_note(num_samples: int, num_reference: int, dim: int) -> str | None:
    """Why sFID is left out for these sizes, or None when it is computed."""
    needed = SFID_SAMPLES_PER_DIM * dim
    if min(num_samples, num_reference) >= needed:
        return None
    return (f"left out: sFID needs >= {SFID_SAMPLES_PER_DIM} x {dim}-d = {needed} images per set "
            f"(have {num_samples} samples, {num_reference} reference)")


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
        self,
        samples: np.ndarray,
        reference: ReferenceBatch | ReferenceStats | str | Path | np.ndarray,
        labels: np.ndarray | None = None,
    ) -> dict[str, Any]:
        """``{"fid", "sfid", "sfid_note", "is", "precision", "recall", "class_agreement", "extractor",
        "num_samples", "num_reference"}``. ``labels: [N]`` (each sample's conditioning class) gives
        ``class_agreement``; without labels, or with an extractor that does not classify the dataset's
        classes, it is None."""
        reference = self.reference_stats(reference)
        features = self.extractor.extract(check_images(samples, "samples"), self.batch_size, self.progress)
        mu, sigma = feature_statistics(features.pooled)
        mu_s, sigma_s = feature_statistics(features.spatial)
        precision, recall = precision_recall(
            reference.pooled, features.pooled, k=self.k, batch_size=self.distance_batch_size,
            device=self.extractor.device,
        )
        note = sfid_note(len(features), reference.num_images, len(mu_s))
        return {
            "fid": frechet_distance(mu, sigma, reference.mu, reference.sigma),
            "sfid": None if note else frechet_distance(mu_s, sigma_s, reference.mu_s, reference.sigma_s),
            "sfid_note": note,
            "is": inception_score(features.logits, split_size=self.is_split_size),
            "precision": precision,
            "recall": recall,
            "class_agreement": self._agreement(features.logits, labels),
            "extractor": self.extractor.name,
            "num_samples": len(features),
            "num_reference": reference.num_images,
        }

    def _agreement(self, logits: np.ndarray, labels: np.ndarray | None) -> float | None:
        if labels is None:
            return None
        if self.extractor.name not in LABEL_EXTRACTORS:
            logger.warning("class agreement needs a domain extractor (%s); %r does not classify the data's classes",
                           ", ".join(LABEL_EXTRACTORS), self.extractor.name)
            return None
        return class_agreement(logits, labels)


def compute_generation_metrics(
    samples: np.ndarray | str | Path,
    reference: ReferenceBatch | str | Path | np.ndarray,
    extractor: str | FeatureExtractor = "inception",
    weights: str | Path | None = None,
    device: str | torch.device = "cpu",
    **scorer_kwargs: Any,
) -> dict[str, Any]:
    """One-shot scoring (``samples``: uint8 ``[N, H, W, C]`` or an ADM ``.npz``, whose ``arr_1`` /
    ``labels`` give class agreement); builds the extractor by name unless one is given. Loops that
    score repeatedly should keep a ``GenerationScorer``."""
    if isinstance(extractor, str):
        extractor = build_extractor(extractor, weights=weights, device=device)
    labels = scorer_kwargs.pop("labels", None)
    if isinstance(samples, (str, Path)):
        samples, labels = load_samples(samples)
    return GenerationScorer(extractor, **scorer_kwargs).score(samples, reference, labels=labels)
