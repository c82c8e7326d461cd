"""Raw image arrays of the embedded datasets, shared by classification, generation and metrics.

Every loader returns ``(images, labels)`` with ``images: uint8 [N, H, W, C]`` (values 0..255) and
``labels: int64 [N]``. Splits are deterministic, so every consumer sees the same held-out set.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

FASHION_MNIST_DEBIAN_ROOT = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
_FASHION_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0


def _check_split(split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"split={split!r} is not known; use 'train' or 'test'")


def load_digits_arrays(split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits (1797 images, 10 classes), embedded: needs no files.

    A fixed permutation holds out 20% as the test split.
    """
    from sklearn.datasets import load_digits

    _check_split(split)
    bunch = load_digits()
    images = np.rint(bunch.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)[..., None]
    labels = bunch.target.astype(np.int64)
    order = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(labels))
    n_test = int(round(len(labels) * DIGITS_TEST_FRACTION))
    idx = order[:n_test] if split == "test" else order[n_test:]
    return images[idx], labels[idx]


def _open_idx(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (the MNIST format), gzipped or not."""
    path = Path(path)
    with _open_idx(path) as f:
        zero, dtype_code, ndim = struct.unpack(">HBB", f.read(4))
        if zero != 0 or dtype_code != 0x08:
            raise ValueError(f"{path} is not an unsigned-byte IDX file (header {zero}, {dtype_code:#x})")
        shape = struct.unpack(f">{ndim}I", f.read(4 * ndim))
        data = np.frombuffer(f.read(), dtype=np.uint8)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path} is truncated: expected {int(np.prod(shape))} values, found {data.size}")
    return data.reshape(shape)


def _find_idx(root: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem}(.gz) not found under {root}. Install the Debian package "
        f"(apt-get install dataset-fashion-mnist, files in {FASHION_MNIST_DEBIAN_ROOT}) or set "
        f"data.root to a folder holding the four IDX files."
    )


def load_fashion_mnist_arrays(split: str = "train", root: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST (28x28 grey, 10 classes) from IDX files; ``root`` defaults to the Debian package."""
    _check_split(split)
    root = Path(root) if root is not None else FASHION_MNIST_DEBIAN_ROOT
    image_stem, label_stem = _FASHION_FILES[split]
    images = read_idx(_find_idx(root, image_stem))[..., None]
    labels = read_idx(_find_idx(root, label_stem)).astype(np.int64)
    if len(images) != len(labels):
        raise ValueError(f"{root}: {len(images)} images but {len(labels)} labels in the {split} split")
    return images, labels


def fashion_mnist_available(root: str | Path | None = None) -> bool:
    root = Path(root) if root is not None else FASHION_MNIST_DEBIAN_ROOT
    try:
        for stems in _FASHION_FILES.values():
            for stem in stems:
                _find_idx(root, stem)
    except FileNotFoundError:
        return False
    return True


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write a uint8 array as a gzipped IDX file (used to build tiny test datasets)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


def class_names(name: str, num_classes: int) -> list[str]:
    """Display names of an embedded dataset's classes (Fashion-MNIST's garments; indices otherwise)."""
    if name == "fashion_mnist":
        return list(FASHION_MNIST_CLASSES)
    return [str(i) for i in range(num_classes)]


def load_arrays(name: str, split: str = "train", root: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Arrays of an embedded dataset by name: ``digits`` or ``fashion_mnist``."""
    if name == "digits":
        return load_digits_arrays(split)
    if name == "fashion_mnist":
        return load_fashion_mnist_arrays(split, root)
    raise ValueError(f"dataset {name!r} has no array loader; use 'digits' or 'fashion_mnist'")
