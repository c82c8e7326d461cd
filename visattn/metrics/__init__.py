"""Generation metrics with ADM-evaluator parity: FID, sFID, IS, improved precision/recall.

Class agreement (``class_agreement``): the share of class-conditional samples that the domain
classifier assigns to their label. Math on features (float64): ``feature_statistics``, ``frechet_distance``, ``inception_score``,
``precision_recall``. Extractors (uint8 ``[N, H, W, C]`` in, ``Features`` out): torch-fidelity's
Inception (``inception``) or a domain CNN (``digits``, ``fashion_mnist``) via ``build_extractor``.
Scoring: ``GenerationScorer(extractor).score(samples, reference)`` or ``compute_generation_metrics``.
CLI: ``python -m visattn.metrics SAMPLES.npz REF.npz --extractor digits``.
"""

from .agreement import class_agreement
from .extractor import EXTRACTOR_NAMES, build_extractor
from .extractor_base import FeatureExtractor, Features, check_images
from .fid import feature_statistics, frechet_distance
from .inception_score import ADM_SPLIT_SIZE, inception_score
from .precision_recall import manifold_radii, precision_recall
from .reference import (
    ReferenceBatch,
    build_reference,
    center_crop_arr,
    dataset_images,
    folder_images,
    load_npz_batch,
    load_samples,
    save_npz_batch,
)
from .scorer import SFID_SAMPLES_PER_DIM, GenerationScorer, ReferenceStats, compute_generation_metrics

__all__ = [
    "ADM_SPLIT_SIZE",
    "EXTRACTOR_NAMES",
    "FeatureExtractor",
    "Features",
    "GenerationScorer",
    "ReferenceBatch",
    "ReferenceStats",
    "build_extractor",
    "SFID_SAMPLES_PER_DIM",
    "build_reference",
    "center_crop_arr",
    "check_images",
    "class_agreement",
    "compute_generation_metrics",
    "dataset_images",
    "feature_statistics",
    "folder_images",
    "frechet_distance",
    "inception_score",
    "load_npz_batch",
    "load_samples",
    "manifold_radii",
    "precision_recall",
    "save_npz_batch",
]
