"""A class-balanced Fashion-MNIST subset as IDX files, so a short profile still sees every class.

The subset is deterministic (the first ``n`` images of each class, in file order) and is what the
study passes as ``data.root``; the report's note names its size.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from visattn.data.idx import write_idx
from visattn.data.sets.fashion_mnist import FILES, fashion_mnist_available, load_fashion_mnist_arrays


def balanced_indices(labels: np.ndarray, per_class: int) -> np.ndarray:
    """Indices of the first ``per_class`` examples of every class, in their original order."""
    if per_class < 1:
        raise ValueError(f"per_class={per_class} must be >= 1")
    chosen = [np.flatnonzero(labels == c)[:per_class] for c in np.unique(labels)]
    short = [int(c) for c, idx in zip(np.unique(labels), chosen, strict=True) if len(idx) < per_class]
    if short:
        raise ValueError(f"classes {short} have fewer than per_class={per_class} examples; lower it")
    return np.sort(np.concatenate(chosen))


def write_fashion_mnist_subset(out: Path, train_per_class: int, test_per_class: int,
                               root: str | Path | None = None) -> Path:
    """Write the four IDX files of a balanced subset to ``out`` (kept if already there); returns ``out``."""
    out = Path(out)
    if fashion_mnist_available(out):
        return out
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for split, per_class in (("train", train_per_class), ("test", test_per_class)):
        images, labels = load_fashion_mnist_arrays(split, root)
        keep = balanced_indices(labels, per_class)
        image_stem, label_stem = FILES[split]
        write_idx(partial / f"{image_stem}.gz", images[keep, ..., 0])
        write_idx(partial / f"{label_stem}.gz", labels[keep].astype(np.uint8))
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)  # a finished subset appears at once, never half written
    return out
