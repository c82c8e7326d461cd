"""Frechet distance between Gaussian fits of feature sets (FID, and sFID on spatial features).

Follows the ADM evaluator: statistics are the sample mean and the unbiased covariance; the matrix
square root comes from ``scipy.linalg.sqrtm``, retried with ``eps * I`` added to both covariances
when the product is singular, and tiny imaginary parts from round-off are dropped.
"""

from __future__ import annotations

import logging

import numpy as np
from scipy import linalg

logger = logging.getLogger(__name__)

IMAGINARY_TOLERANCE = 1e-3


def feature_statistics(features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``features: [N, D]`` -> ``(mu [D], sigma [D, D])`` in float64 (covariance with N - 1)."""
    features = np.asarray(features)
    if features.ndim != 2 or features.shape[0] < 2:
        raise ValueError(f"features must be [N, D] with N >= 2 to estimate a covariance; got shape {features.shape}")
    features = features.astype(np.float64, copy=False)
    return features.mean(axis=0), np.cov(features, rowvar=False)


def _sqrtm(matrix: np.ndarray) -> np.ndarray:
    """``scipy.linalg.sqrtm`` without its ``disp`` argument (removed in recent SciPy releases, where
    the function returns only the root); non-finite entries flag a failed root either way."""
    return np.asarray(linalg.sqrtm(matrix))


def frechet_distance(
    mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray, eps: float = 1e-6
) -> float:
    """``||mu1 - mu2||^2 + Tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2))`` for ``mu: [D]``, ``sigma: [D, D]``."""
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    if mu1.shape != mu2.shape:
        raise ValueError(f"mean vectors differ in length: {mu1.shape} vs {mu2.shape} (features from different extractors?)")
    if sigma1.shape != sigma2.shape or sigma1.shape != (mu1.shape[0], mu1.shape[0]):
        raise ValueError(f"covariances {sigma1.shape}, {sigma2.shape} do not match mean length {mu1.shape[0]}")

    diff = mu1 - mu2
    covmean = _sqrtm(sigma1 @ sigma2)
    if not np.isfinite(covmean).all():
        logger.warning("Frechet distance: singular covariance product; adding %g to the diagonals", eps)
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = _sqrtm((sigma1 + offset) @ (sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=IMAGINARY_TOLERANCE):
            raise ValueError(
                f"Frechet distance: sqrtm has an imaginary component of {np.max(np.abs(covmean.imag)):.3g}; "
                "the covariances are badly conditioned (use more samples than feature dimensions)"
            )
        covmean = covmean.real
    return float(diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * np.trace(covmean))
