"""Reference batches in the ADM ``.npz`` format, and building them from a dataset or an image folder.

An ADM batch holds ``arr_0`` (uint8 images ``[N, H, W, C]``) and, for reference batches, the
statistics ``mu``, ``sigma`` (pooled features) and ``mu_s``, ``sigma_s`` (spatial features), which
ADM computes over a whole dataset while ``arr_0`` keeps a subset for precision/recall. We add the
key ``extractor`` (the name of the extractor that made the statistics); ADM's evaluator ignores it.
"""

from __future__ import annotations

import io
import logging
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from visattn.data.registry import is_array_dataset, load_arrays
from visattn.utils.checkpoint import atomic_write_bytes

from .extractor_base import FeatureExtractor, check_images
from .fid import feature_statistics

logger = logging.getLogger(__name__)

STATISTICS_KEYS = ("mu", "sigma", "mu_s", "sigma_s")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")


@dataclass(frozen=True)
class ReferenceBatch:
    images: np.ndarray  # uint8 [N, H, W, C] (arr_0)
    mu: np.ndarray | None = None  # [D]
    sigma: np.ndarray | None = None  # [D, D]
    mu_s: np.ndarray | None = None  # [S]
    sigma_s: np.ndarray | None = None  # [S, S]
    extractor: str | None = None  # who made the statistics; None in ADM's own files (Inception)

    @property
    def has_statistics(self) -> bool:
        return self.mu is not None


NPZ_FORMAT = ("an ADM .npz written by numpy.savez: arr_0 uint8 [N, H, W, C] images "
              "(samples may add arr_1 or labels: int [N] class labels)")
LABEL_KEYS = ("arr_1", "labels")  # ADM's image_sample.py writes labels as arr_1


@contextmanager
def _open_npz(path: str | Path) -> Iterator[np.lib.npyio.NpzFile]:
    """``np.load`` of an .npz archive; any other or damaged file fails naming it and the format."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"batch file {path} does not exist; give {NPZ_FORMAT}")
    with path.open("rb") as f:
        magic = f.read(6)
    if magic == b"\x93NUMPY":
        raise ValueError(f"{path} is a single .npy array, not an .npz archive; expected {NPZ_FORMAT}")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not a zip archive (damaged, or not made by numpy.savez); expected {NPZ_FORMAT}")
    try:
        with np.load(path, allow_pickle=False) as obj:
            yield obj
    except (zipfile.BadZipFile, EOFError, OSError) as err:
        raise ValueError(f"{path} could not be read ({err}); expected {NPZ_FORMAT}") from err


def load_npz_batch(path: str | Path) -> ReferenceBatch:
    """Read an ADM ``.npz`` (samples or reference); statistics are read when present."""
    with _open_npz(path) as obj:
        if "arr_0" not in obj:
            raise ValueError(f"{path} has no arr_0 (keys: {sorted(obj.keys())}); expected {NPZ_FORMAT}")
        present = [key for key in STATISTICS_KEYS if key in obj]
        if present and len(present) != len(STATISTICS_KEYS):
            raise ValueError(f"{path} holds {present} but not all of {STATISTICS_KEYS}")
        stats = {key: obj[key] for key in present}
        extractor = str(obj["extractor"]) if "extractor" in obj else None
        images = check_images(obj["arr_0"], f"arr_0 of {path}")
    return ReferenceBatch(images=images, extractor=extractor, **stats)


def load_samples(path: str | Path) -> tuple[np.ndarray, np.ndarray | None]:
    """A samples ``.npz`` -> (images uint8 ``[N, H, W, C]``, labels int ``[N]`` or None): the labels
    from ``arr_1`` (ADM's layout) or ``labels``, when the file holds them."""
    images = load_npz_batch(path).images
    with _open_npz(path) as obj:
        key = next((k for k in LABEL_KEYS if k in obj), None)
        labels = None if key is None else obj[key]
    if labels is not None:
        labels = np.asarray(labels)
        if labels.shape != (len(images),) or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"{key} of {path} must be int labels [N] with N = {len(images)} (one per image); "
                             f"got {labels.dtype} {labels.shape}")
    return images, labels


def save_npz_batch(path: str | Path, batch: ReferenceBatch, labels: np.ndarray | None = None) -> None:
    """Write ``batch`` as an ADM ``.npz`` (atomically); ``labels: int [N]`` go to ``arr_1`` (ADM's layout
    for class-conditional samples)."""
    arrays = {"arr_0": check_images(batch.images)}
    if labels is not None:
        labels = np.asarray(labels)
        if labels.shape != (len(batch.images),):
            raise ValueError(f"labels must be [N] with N = {len(batch.images)}; got shape {labels.shape}")
        arrays["arr_1"] = labels.astype(np.int64)
    if batch.has_statistics:
        arrays.update({key: getattr(batch, key) for key in STATISTICS_KEYS})
        if batch.extractor is not None:
            arrays["extractor"] = np.array(batch.extractor)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(path, buffer.getvalue())


def center_crop_arr(image: Image.Image, size: int) -> np.ndarray:
    """ADM's preprocessing: halve with a box filter while the short side is >= 2 * size, resize
    bicubically so the short side is ``size``, then take the central ``size x size`` crop."""
    while min(image.size) >= 2 * size:
        image = image.resize(tuple(side // 2 for side in image.size), resample=Image.Resampling.BOX)
    scale = size / min(image.size)
    image = image.resize(tuple(round(side * scale) for side in image.size), resample=Image.Resampling.BICUBIC)
    array = np.asarray(image)
    top, left = (array.shape[0] - size) // 2, (array.shape[1] - size) // 2
    return array[top : top + size, left : left + size]


def _crop_all(images: np.ndarray, size: int) -> np.ndarray:
    """``images: uint8 [N, H, W, C]`` -> ``[N, size, size, C]`` through ``center_crop_arr``."""
    grey = images.shape[-1] == 1
    crops = [center_crop_arr(Image.fromarray(img[..., 0] if grey else img), size) for img in images]
    out = np.stack(crops)
    return out[..., None] if grey else out


def dataset_images(name: str, split: str = "train", size: int | None = None, root: str | Path | None = None) -> np.ndarray:
    """uint8 ``[N, H, W, C]`` images of an embedded dataset, centre-cropped to ``size`` if given."""
    images, _ = load_arrays(name, split, root)
    return images if size is None or images.shape[1:3] == (size, size) else _crop_all(images, size)


def folder_images(folder: str | Path, size: int) -> np.ndarray:
    """uint8 ``[N, size, size, 3]``: every image under ``folder`` (recursive, sorted), centre-cropped."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {folder} does not exist")
    paths = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not paths:
        raise ValueError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {folder}")
    crops = []
    for path in paths:
        with Image.open(path) as image:
            crops.append(center_crop_arr(image.convert("RGB"), size))
    return np.stack(crops)


def build_reference(
    source: str | Path,
    extractor: FeatureExtractor | None = None,
    size: int | None = None,
    split: str = "train",
    keep_images: int | None = None,
    root: str | Path | None = None,
    batch_size: int = 64,
    seed: int = 0,
) -> ReferenceBatch:
    """A reference batch from a dataset name (``digits``, ``fashion_mnist``) or an image folder.

    With an ``extractor``, the statistics are computed over every image; ``arr_0`` keeps all of
    them, or a seeded random subset of ``keep_images`` (ADM keeps 10k for precision/recall).
    """
    if is_array_dataset(str(source)):
        images = dataset_images(str(source), split, size, root)
    else:
        if size is None:
            raise ValueError(f"building a reference from the folder {source} needs size= (the side in pixels)")
        images = folder_images(source, size)
    stats: dict[str, np.ndarray] = {}
    if extractor is not None:
        features = extractor.extract(images, batch_size=batch_size)
        stats["mu"], stats["sigma"] = feature_statistics(features.pooled)
        stats["mu_s"], stats["sigma_s"] = feature_statistics(features.spatial)
    if keep_images is not None and keep_images < len(images):
        keep = np.sort(np.random.default_rng(seed).choice(len(images), keep_images, replace=False))
        images = images[keep]
    logger.info("reference batch from %s: %d images of %s", source, len(images), images.shape[1:])
    return ReferenceBatch(images=images, extractor=extractor.name if extractor else None, **stats)
