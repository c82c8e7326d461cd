"""Class agreement: how often a domain classifier assigns a generated sample to its conditioning label.

    class_agreement(logits [N, K], labels [N]) -> float in [0, 1]

With the Fashion-MNIST extractor (test accuracy ~0.87 on real images) real test images score ~0.87,
so this is the ceiling a perfect generator approaches. Only extractors whose classes are the
dataset's classes can score it (the domain classifiers, not Inception's ImageNet logits).
"""

from __future__ import annotations

import numpy as np

# Extractors whose logits index the dataset's own classes (so a label can be checked against them).
LABEL_EXTRACTORS = ("digits", "fashion_mnist")


def check_labels(labels: np.ndarray, num_samples: int, num_classes: int, what: str = "labels") -> np.ndarray:
    """Integer class labels ``[N]`` in ``[0, num_classes)``, one per sample."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) != num_samples:
        raise ValueError(f"{what} must be a 1-D array with one label per sample ({num_samples}); got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{what} must hold integer class indices; got dtype {labels.dtype}")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"{what} must lie in [0, {num_classes}); got values {labels.min()}..{labels.max()}")
    return labels.astype(np.int64, copy=False)


def class_agreement(logits: np.ndarray, labels: np.ndarray) -> float:
    """Share of samples whose arg-max class (``logits: [N, K]``) equals their label (``labels: [N]``)."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or len(logits) == 0:
        raise ValueError(f"logits must be [N, K] with N >= 1; got shape {logits.shape}")
    labels = check_labels(labels, len(logits), logits.shape[1])
    return float((logits.argmax(axis=1) == labels).mean())
