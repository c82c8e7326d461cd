"""Raw image arrays of the array datasets, by the names older code imports.

New code asks ``visattn.data.registry`` (``load_arrays``, ``get_array_dataset``, ``class_names``);
the per-dataset loaders live in ``visattn/data/sets/``. Arrays: ``images: uint8 [N, H, W, C]``,
``labels: int64 [N]``.
"""

from __future__ import annotations

from .idx import read_idx, write_idx
from .registry import class_names, load_arrays
from .sets.digits import SPLIT_SEED as DIGITS_SPLIT_SEED
from .sets.digits import TEST_FRACTION as DIGITS_TEST_FRACTION
from .sets.digits import load_digits_arrays
from .sets.fashion_mnist import CLASSES as FASHION_MNIST_CLASSES
from .sets.fashion_mnist import DEBIAN_ROOT as FASHION_MNIST_DEBIAN_ROOT
from .sets.fashion_mnist import FILES as _FASHION_FILES
from .sets.fashion_mnist import fashion_mnist_available, load_fashion_mnist_arrays

__all__ = [
    "DIGITS_SPLIT_SEED", "DIGITS_TEST_FRACTION", "FASHION_MNIST_CLASSES", "FASHION_MNIST_DEBIAN_ROOT", "_FASHION_FILES",
    "class_names", "fashion_mnist_available", "load_arrays", "load_digits_arrays", "load_fashion_mnist_arrays",
    "read_idx", "write_idx",
]
