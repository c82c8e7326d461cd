"""Fashion-MNIST (28x28 grey, 10 classes, 60k train / 10k test) from its four IDX files.

The files are read from ``data.root`` or, when that is null, from the Debian package
``dataset-fashion-mnist``'s folder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..idx import read_idx
from ..registry import ArrayDatasetSpec, register_array_dataset

DEBIAN_ROOT = Path("/usr/share/datasets/fashion-mnist")
CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FILES_HINT = (
    f"install the Debian package (apt-get install dataset-fashion-mnist, files in {DEBIAN_ROOT}) or set "
    f"data.root to a folder holding the four IDX files"
)


def find_idx(root: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(f"Fashion-MNIST file {stem}(.gz) not found under {root}: {FILES_HINT}")


def load_fashion_mnist_arrays(split: str = "train", root: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [N, 28, 28, 1], labels int64 [N])``; ``root`` defaults to the Debian package."""
    if split not in FILES:
        raise ValueError(f"split={split!r} is not known; use one of {tuple(FILES)}")
    root = Path(root) if root is not None else DEBIAN_ROOT
    image_stem, label_stem = FILES[split]
    images = read_idx(find_idx(root, image_stem))[..., None]
    labels = read_idx(find_idx(root, label_stem)).astype(np.int64)
    if len(images) != len(labels):
        raise ValueError(f"{root}: {len(images)} images but {len(labels)} labels in the {split} split")
    return images, labels


def fashion_mnist_available(root: str | Path | None = None) -> bool:
    """Whether all four IDX files are under ``root`` (default: the Debian package's folder)."""
    root = Path(root) if root is not None else DEBIAN_ROOT
    try:
        for stems in FILES.values():
            for stem in stems:
                find_idx(root, stem)
    except FileNotFoundError:
        return False
    return True


SPEC = register_array_dataset(ArrayDatasetSpec(
    name="fashion_mnist",
    load=load_fashion_mnist_arrays,
    classes=CLASSES,
    image_size=28,
    channels=1,
    default_root=DEBIAN_ROOT,
    files_hint=FILES_HINT,
    extractor="fashion_mnist",
))
