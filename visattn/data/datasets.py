"""Classification datasets by name (``data.name``): digits, fashion_mnist, imagefolder, fake.

Every dataset yields ``(image [C, H, W] float, label int)``; ``build_datasets`` returns the train
and held-out splits, ``check_data_config`` validates a ``data`` config before any work starts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder

from .sources import FASHION_MNIST_DEBIAN_ROOT, load_arrays
from .transforms import array_transform, imagefolder_transform

DATASETS = ("digits", "fashion_mnist", "imagefolder", "fake")
IMAGEFOLDER_SPLITS = ("train", "val")


class ArrayDataset(Dataset):
    """uint8 images [N, H, W, C] + int64 labels [N], transformed per sample from PIL."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform: Callable | None = None) -> None:
        self.images = images
        self.labels = labels
        self.transform = transform
        self.mode = "L" if images.shape[-1] == 1 else "RGB"

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, idx: int) -> tuple[Any, int]:
        array = self.images[idx]
        image = Image.fromarray(array[..., 0] if self.mode == "L" else array, mode=self.mode)
        return (self.transform(image) if self.transform else image), int(self.labels[idx])


class FakeDataset(Dataset):
    """Random normalised images and labels, the same for an index on every call (throughput runs)."""

    def __init__(self, size: int, image_shape: tuple[int, int, int], num_classes: int, seed: int = 0) -> None:
        self.size = size
        self.image_shape = image_shape
        self.num_classes = num_classes
        self.seed = seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        label = int(torch.randint(self.num_classes, (), generator=gen))
        return torch.randn(self.image_shape, generator=gen), label


def check_data_config(data: Mapping[str, Any]) -> None:
    """Raise ValueError / FileNotFoundError naming the key, the bad value and the fix."""
    name = data.get("name")
    if name not in DATASETS:
        raise ValueError(f"data.name={name!r} is not known; use one of {DATASETS} (data=<name> on the command line)")
    for key in ("image_size", "in_chans", "num_classes"):
        value = data.get(key)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"data.{key}={value!r} must be a positive integer")
    for key in ("mean", "std"):
        if len(data[key]) != data["in_chans"]:
            raise ValueError(
                f"data.{key}={list(data[key])} needs one value per channel (data.in_chans={data['in_chans']})"
            )
    root = data.get("root")
    if name == "imagefolder":
        if root is None:
            raise ValueError("data.root=null: data=imagefolder needs data.root=PATH, a folder with train/ and val/")
        for split in IMAGEFOLDER_SPLITS:
            if not (Path(root) / split).is_dir():
                raise FileNotFoundError(
                    f"data.root={root}: folder {Path(root) / split} does not exist; data=imagefolder expects "
                    f"ImageNet layout ROOT/train/<class>/*.jpeg and ROOT/val/<class>/*.jpeg"
                )
    elif name == "fashion_mnist" and root is not None and not Path(root).is_dir():
        raise FileNotFoundError(
            f"data.root={root} does not exist; point it at the folder holding the Fashion-MNIST IDX files or set "
            f"data.root=null to use {FASHION_MNIST_DEBIAN_ROOT} (apt-get install dataset-fashion-mnist)"
        )


def build_datasets(data: Mapping[str, Any], aug: Mapping[str, Any], seed: int = 0) -> tuple[Dataset, Dataset]:
    """(train, held-out) datasets for the ``data`` config, train split augmented by ``aug``."""
    check_data_config(data)
    name = data["name"]
    if name == "imagefolder":
        root = Path(data["root"])
        train = ImageFolder(root / "train", transform=imagefolder_transform(data, aug, train=True))
        val = ImageFolder(root / "val", transform=imagefolder_transform(data, aug, train=False))
        if len(train.classes) != data["num_classes"]:
            raise ValueError(
                f"data.num_classes={data['num_classes']} but {root / 'train'} has {len(train.classes)} class "
                f"folders; set data.num_classes={len(train.classes)}"
            )
        return train, val
    if name == "fake":
        shape = (data["in_chans"], data["image_size"], data["image_size"])
        return (
            FakeDataset(data.get("train_size", 1024), shape, data["num_classes"], seed=seed),
            FakeDataset(data.get("val_size", 256), shape, data["num_classes"], seed=seed + 1),
        )
    splits = []
    for split, train in (("train", True), ("test", False)):
        images, labels = load_arrays(name, split, data.get("root"))
        if images.shape[-1] != data["in_chans"]:
            raise ValueError(f"data.in_chans={data['in_chans']} but {name} images have {images.shape[-1]} channels")
        transform = array_transform(data, aug, train=train, native_size=images.shape[1])
        splits.append(ArrayDataset(images, labels, transform))
    return splits[0], splits[1]
