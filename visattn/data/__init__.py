"""Datasets and loaders: the array-dataset registry and its built-in sets, classification datasets,
image-folder decoding faults, transforms, samplers."""

from . import sets  # noqa: F401  (registers the built-in array datasets by name)
