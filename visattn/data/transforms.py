"""Per-sample image transforms for classification, built from the ``data`` and ``aug`` configs.

ImageFolder data use timm's ImageNet pipeline (``timm.data.create_transform``: random resized
crop, flip, RandAugment, random erasing); the small in-memory datasets use a light pipeline on
PIL images (resize, padded random crop, flip, optional RandAugment, random erasing).
Outputs are normalised tensors [C, H, W].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torchvision.transforms as T
from timm.data import create_transform
from timm.data.auto_augment import rand_augment_transform
from timm.data.random_erasing import RandomErasing


def imagefolder_transform(data: Mapping[str, Any], aug: Mapping[str, Any], train: bool):
    """timm's transform for [3, image_size, image_size] ImageNet-style inputs."""
    common = dict(
        input_size=(data["in_chans"], data["image_size"], data["image_size"]),
        interpolation=data.get("interpolation", "bicubic"),
        mean=tuple(data["mean"]),
        std=tuple(data["std"]),
        crop_pct=data.get("crop_pct", 0.875),
    )
    if not train:
        return create_transform(is_training=False, **common)
    return create_transform(
        is_training=True,
        scale=tuple(aug.get("scale") or (0.08, 1.0)),
        hflip=aug.get("hflip", 0.5),
        color_jitter=aug.get("color_jitter") or 0.0,
        auto_augment=aug.get("auto_augment"),
        re_prob=aug.get("re_prob", 0.0),
        re_mode=aug.get("re_mode", "pixel"),
        re_count=aug.get("re_count", 1),
        **common,
    )


def array_transform(data: Mapping[str, Any], aug: Mapping[str, Any], train: bool, native_size: int):
    """Transform for PIL images of a small in-memory dataset, resized from ``native_size`` to
    ``data.image_size``."""
    size = data["image_size"]
    steps: list = [T.Resize(size, interpolation=T.InterpolationMode.BICUBIC)] if size != native_size else []
    if train:
        if aug.get("crop_padding"):
            steps.append(T.RandomCrop(size, padding=aug["crop_padding"]))
        if aug.get("hflip"):
            steps.append(T.RandomHorizontalFlip(aug["hflip"]))
        if aug.get("auto_augment"):
            mean_pixel = tuple(round(255 * m) for m in data["mean"])
            steps.append(rand_augment_transform(aug["auto_augment"], {"img_mean": mean_pixel}))
    steps += [T.ToTensor(), T.Normalize(tuple(data["mean"]), tuple(data["std"]))]
    if train and aug.get("re_prob"):
        steps.append(RandomErasing(aug["re_prob"], mode=aug.get("re_mode", "pixel"), max_count=aug.get("re_count", 1),
                                   device="cpu"))
    return T.Compose(steps)
