"""Classification datasets by name (``data.name``): any registered array dataset (digits,
fashion_mnist, ...; see ``visattn.data.registry``), ``imagefolder`` and ``fake``.

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

from .images import ImageFolderSplit, check_bad_images_mode
from .registry import (
    ArrayDatasetSpec,
    dataset_names,
    get_array_dataset,
    import_dataset_module,
    is_array_dataset,
    load_arrays,
)
from .transforms import array_transform, imagefolder_transform
from .verify import check_verify_level, verify_split

IMAGEFOLDER_SPLITS = ("train", "val")
# data keys of data=imagefolder for bad files, and their defaults (conf/data/imagefolder.yaml)
BAD_IMAGES_DEFAULT = "error"
VERIFY_DEFAULTS = {"verify_train": "none", "verify_val": "decode"}


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
    import_dataset_module(data)
    name = data.get("name")
    if name not in dataset_names():
        raise ValueError(
            f"data.name={name!r} is not known; use one of {tuple(dataset_names())} (data=<name> on the command "
            f"line; a new array dataset: data.module=<module that registers it>)"
        )
    for key in ("image_size", "in_chans", "num_classes"):
        value = data.get(key)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"data.{key}={value!r} must be a positive integer")
    for key in ("mean", "std"):
        if len(data[key]) != data["in_chans"]:
            raise ValueError(
                f"data.{key}={list(data[key])} needs one value per channel (data.in_chans={data['in_chans']})"
            )
    if is_array_dataset(name):
        _check_array_config(data, get_array_dataset(name))
    elif name == "imagefolder":
        _check_imagefolder_config(data)


def _check_array_config(data: Mapping[str, Any], spec: ArrayDatasetSpec) -> None:
    for key, actual in (("in_chans", spec.channels), ("num_classes", spec.num_classes)):
        if data[key] != actual:
            raise ValueError(f"data.{key}={data[key]} but dataset {spec.name} has {actual}; set data.{key}={actual}")
    root = data.get("root")
    if root is not None and not Path(root).is_dir():
        default = f" or set data.root=null to use {spec.default_root}" if spec.default_root is not None else ""
        hint = f" ({spec.files_hint})" if spec.files_hint else ""
        raise FileNotFoundError(
            f"data.root={root} does not exist; point it at the folder holding the {spec.name} files{default}{hint}"
        )


def _check_imagefolder_config(data: Mapping[str, Any]) -> None:
    root = data.get("root")
    if root is None:
        raise ValueError("data.root=null: data=imagefolder needs data.root=PATH, a folder with train/ and val/")
    for split in IMAGEFOLDER_SPLITS:
        if not (Path(root) / split).is_dir():
            raise FileNotFoundError(
                f"data.root={root}: folder {Path(root) / split} does not exist; data=imagefolder expects "
                f"ImageNet layout ROOT/train/<class>/*.jpeg and ROOT/val/<class>/*.jpeg"
            )
    _check_same_classes(Path(root))
    check_bad_images_mode(data.get("bad_images", BAD_IMAGES_DEFAULT))
    for key, default in VERIFY_DEFAULTS.items():
        check_verify_level(f"data.{key}", data.get(key, default))


def _check_same_classes(root: Path) -> None:
    """Each split's labels are its sorted class folder names, so train/ and val/ need the same folders."""
    train, val = (sorted(p.name for p in (root / split).iterdir() if p.is_dir()) for split in IMAGEFOLDER_SPLITS)
    if train != val:
        only = {split: sorted(set(mine) - set(other)) for split, mine, other in (("train", train, val),
                                                                                ("val", val, train))}
        differences = "; ".join(f"only {split}/ has {names}" for split, names in only.items() if names)
        raise ValueError(
            f"data.root={root}: {differences}. Both splits need the same class folders (labels are their sorted "
            f"names, so a missing or extra folder would give val images other classes' labels)"
        )


def build_imagefolder_split(data: Mapping[str, Any], split: str, transform: Callable | None) -> ImageFolderSplit:
    """``data.root/<split>`` as an ``ImageFolderSplit`` under ``data.bad_images``, checked up front at
    the level ``data.verify_<split>`` (bad files raise, or are dropped and listed, before any training)."""
    bad_images = data.get("bad_images", BAD_IMAGES_DEFAULT)
    dataset = ImageFolderSplit(Path(data["root"]) / split, transform=transform, bad_images=bad_images)
    level = data.get(f"verify_{split}", VERIFY_DEFAULTS.get(f"verify_{split}", "none"))
    verify_split(dataset, bad_images, level, workers=max(1, int(data.get("num_workers") or 1)))
    return dataset


def build_datasets(data: Mapping[str, Any], aug: Mapping[str, Any], seed: int = 0) -> tuple[Dataset, Dataset]:
    """(train, held-out) datasets for the ``data`` config, train split augmented by ``aug``."""
    check_data_config(data)
    name = data["name"]
    if name == "imagefolder":
        train = build_imagefolder_split(data, "train", imagefolder_transform(data, aug, train=True))
        val = build_imagefolder_split(data, "val", imagefolder_transform(data, aug, train=False))
        if len(train.classes) != data["num_classes"]:
            raise ValueError(
                f"data.num_classes={data['num_classes']} but {train.root} has {len(train.classes)} class "
                f"folders; set data.num_classes={len(train.classes)}"
            )
        return train, val
    if name == "fake":
        shape = (data["in_chans"], data["image_size"], data["image_size"])
        return (
            FakeDataset(data.get("train_size", 1024), shape, data["num_classes"], seed=seed),
            FakeDataset(data.get("val_size", 256), shape, data["num_classes"], seed=seed + 1),
        )
    spec = get_array_dataset(name)
    splits = []
    for split, train in ((spec.train_split, True), (spec.heldout_split, False)):
        images, labels = load_arrays(name, split, data.get("root"))
        transform = array_transform(data, aug, train=train, native_size=images.shape[1])
        splits.append(ArrayDataset(images, labels, transform))
    return splits[0], splits[1]
