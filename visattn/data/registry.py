"""Name -> array dataset: the one place that knows each in-memory dataset's facts.

An array dataset is a module that calls ``register_array_dataset(ArrayDatasetSpec(...))`` with its
loader and facts (class names, native size, channels, splits, where its files live, the domain
feature extractor that scores generated images of it). The modules under ``visattn/data/sets/``
register on import; a module elsewhere is named by the data config's ``module`` key
(``data.module=mypackage.mydata``) and imported by ``import_dataset_module``. Adding a dataset is
that module plus ``conf/data/<name>.yaml``; nothing else names it::

    # mypackage/mydata.py
    def load(split: str, root: Path | None) -> tuple[np.ndarray, np.ndarray]: ...
    register_array_dataset(ArrayDatasetSpec("mydata", load, classes=("cat", "dog"), image_size=32, channels=3))

    # conf/data/mydata.yaml: name: mydata, module: mypackage.mydata, root: null, image_size: 32,
    #   in_chans: 3, num_classes: 2, mean: [...], std: [...], num_workers: 0

Every loader returns ``(images, labels)``: ``images: uint8 [N, H, W, C]`` (values 0..255),
``labels: int64 [N]`` in ``0 .. num_classes - 1``. Splits are deterministic, so every consumer
(classification, generation, metrics) sees the same held-out set.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# The two non-array datasets, built by visattn.data.datasets from the config alone.
FOLDER_DATASETS = ("imagefolder", "fake")

ArrayLoader = Callable[[str, Path | None], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class ArrayDatasetSpec:
    """Everything the project needs to know about one in-memory dataset.

    ``load(split, root)`` returns ``(images uint8 [N, H, W, C], labels int64 [N])``; ``root`` is
    ``data.root`` or, when that is null, ``default_root`` (None for an embedded dataset).
    """

    name: str
    load: ArrayLoader
    classes: tuple[str, ...]  # display names, index = label
    image_size: int  # native side length in pixels
    channels: int  # 1 (grey) or 3 (RGB)
    splits: tuple[str, str] = ("train", "test")  # (training split, held-out split)
    default_root: Path | None = None  # where the files live when data.root is null; None: embedded
    files_hint: str = ""  # how to obtain the files, quoted in errors
    extractor: str | None = None  # domain feature extractor for generation metrics; None: Inception

    def __post_init__(self) -> None:
        if not self.name or self.name in FOLDER_DATASETS:
            raise ValueError(f"array dataset name {self.name!r} is empty or taken by {FOLDER_DATASETS}")
        if self.channels not in (1, 3):
            raise ValueError(f"dataset {self.name}: channels={self.channels}; use 1 (grey) or 3 (RGB)")
        if self.image_size < 1 or len(self.classes) < 1:
            raise ValueError(f"dataset {self.name}: image_size and the class list must be positive")
        if len(self.splits) != 2 or self.splits[0] == self.splits[1]:
            raise ValueError(f"dataset {self.name}: splits={self.splits} must be (training split, held-out split)")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def train_split(self) -> str:
        return self.splits[0]

    @property
    def heldout_split(self) -> str:
        return self.splits[1]


_ARRAY_DATASETS: dict[str, ArrayDatasetSpec] = {}


def register_array_dataset(spec: ArrayDatasetSpec) -> ArrayDatasetSpec:
    """Make ``spec.name`` loadable by name everywhere (``data=<name>``, metrics, generation).

    Registering the same spec again is a no-op; another spec under a taken name is refused.
    """
    known = _ARRAY_DATASETS.get(spec.name)
    if known is not None and known != spec:
        raise ValueError(f"array dataset {spec.name!r} is already registered (loader {known.load.__qualname__})")
    _ARRAY_DATASETS[spec.name] = spec
    return spec


def unregister_array_dataset(name: str) -> None:
    """Forget a registered dataset (tests that register a temporary one clean up with this)."""
    _ARRAY_DATASETS.pop(name, None)


def array_dataset_names() -> list[str]:
    return sorted(_ARRAY_DATASETS)


def dataset_names() -> list[str]:
    """Every valid ``data.name``: the registered array datasets, then ``imagefolder`` and ``fake``."""
    return [*array_dataset_names(), *FOLDER_DATASETS]


def is_array_dataset(name: str) -> bool:
    return name in _ARRAY_DATASETS


def get_array_dataset(name: str) -> ArrayDatasetSpec:
    try:
        return _ARRAY_DATASETS[name]
    except KeyError:
        raise ValueError(
            f"dataset {name!r} has no array loader; registered: {', '.join(array_dataset_names())} "
            f"(a new one: a module calling visattn.data.registry.register_array_dataset, named by data.module)"
        ) from None


def import_dataset_module(data: Mapping[str, Any]) -> None:
    """Import ``data.module`` (a dotted module path) when set, so the dataset it registers is known."""
    module = data.get("module")
    if not module:
        return
    try:
        importlib.import_module(str(module))
    except ImportError as err:
        raise ValueError(
            f"data.module={module!r} cannot be imported ({err}); give the dotted path of a module on "
            f"PYTHONPATH that calls register_array_dataset"
        ) from err


def dataset_root(spec: ArrayDatasetSpec, root: str | Path | None) -> Path | None:
    """The folder the loader reads: ``root`` when given, else the dataset's default."""
    return Path(root) if root is not None else spec.default_root


def load_arrays(name: str, split: str = "train", root: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [N, H, W, C], labels int64 [N])`` of a registered dataset's ``split``."""
    spec = get_array_dataset(name)
    if split not in spec.splits:
        raise ValueError(f"split={split!r} is not a split of {name}; use one of {spec.splits}")
    images, labels = spec.load(split, dataset_root(spec, root))
    _check_arrays(spec, split, images, labels)
    return images, labels


def _check_arrays(spec: ArrayDatasetSpec, split: str, images: np.ndarray, labels: np.ndarray) -> None:
    where = f"dataset {spec.name} ({split} split, loader {spec.load.__qualname__})"
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8 or images.ndim != 4:
        raise ValueError(f"{where} must return uint8 images [N, H, W, C]; got {getattr(images, 'dtype', images)}")
    if images.shape[-1] != spec.channels:
        raise ValueError(f"{where} returned {images.shape[-1]} channels; its spec says channels={spec.channels}")
    labels_ok = isinstance(labels, np.ndarray) and labels.dtype == np.int64 and labels.shape == (len(images),)
    if not labels_ok:
        raise ValueError(f"{where} must return int64 labels [N] for {len(images)} images; got {labels!r:.80}")
    if len(labels) and (labels.min() < 0 or labels.max() >= spec.num_classes):
        raise ValueError(f"{where} has labels outside 0..{spec.num_classes - 1} (its {spec.num_classes} classes)")


def class_names(name: str, num_classes: int) -> list[str]:
    """Display names of a dataset's classes: the registered ones, else the indices as strings."""
    if is_array_dataset(name):
        return list(get_array_dataset(name).classes)
    return [str(i) for i in range(num_classes)]


def domain_extractor(name: str) -> str | None:
    """The domain feature extractor registered for a dataset's generated images (None: use Inception)."""
    return get_array_dataset(name).extractor if is_array_dataset(name) else None
