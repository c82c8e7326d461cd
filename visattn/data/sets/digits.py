"""scikit-learn's 8x8 digits (1797 images, 10 classes), embedded: needs no files.

A fixed permutation holds out 20% as the test split.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..registry import ArrayDatasetSpec, register_array_dataset

TEST_FRACTION = 0.2
SPLIT_SEED = 0
SPLITS = ("train", "test")


def load_digits_arrays(split: str = "train", root: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [N, 8, 8, 1], labels int64 [N])``; ``root`` is unused (the data are embedded)."""
    from sklearn.datasets import load_digits

    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not known; use one of {SPLITS}")
    bunch = load_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)[..., None]
    labels = bunch.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    n_test = int(round(len(labels) * TEST_FRACTION))
    idx = order[:n_test] if split == "test" else order[n_test:]
    return images[idx], labels[idx]


SPEC = register_array_dataset(ArrayDatasetSpec(
    name="digits",
    load=load_digits_arrays,
    classes=tuple(str(i) for i in range(10)),
    image_size=8,
    channels=1,
    splits=SPLITS,
    extractor="digits",
))
