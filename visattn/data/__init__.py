"""Datasets and loaders: the array-dataset registry and its built-in sets, classification datasets,
image-folder decoding faults (``images``, ``verify``), transforms, samplers."""

from . import sets  # noqa: F401  (registers the built-in array datasets by name)
from .registry import (
    ArrayDatasetSpec,
    array_dataset_names,
    class_names,
    dataset_names,
    domain_extractor,
    get_array_dataset,
    is_array_dataset,
    load_arrays,
    register_array_dataset,
)

__all__ = [
    "ArrayDatasetSpec", "array_dataset_names", "class_names", "dataset_names", "domain_extractor",
    "get_array_dataset", "is_array_dataset", "load_arrays", "register_array_dataset",
]
