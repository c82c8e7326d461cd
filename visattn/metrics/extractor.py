"""Feature extractors by name: ``build_extractor`` and the names it knows.

The interface (``FeatureExtractor``, ``Features``, ``check_images``) lives in ``extractor_base``, which
the extractors ``inception`` and ``domain`` build on; this module sits above all three, so it can import
them directly. It re-exports the interface, which has always been importable from here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from visattn.data import array_dataset_names, domain_extractor

from . import domain, inception
from .extractor_base import FeatureExtractor, Features, check_images

__all__ = [  # the interface is re-exported: it was defined here before ``extractor_base`` split off
    "EXTRACTOR_NAMES", "FeatureExtractor", "Features", "build_extractor", "check_images", "extractor_names"
]


def extractor_names() -> tuple[str, ...]:
    """``inception`` and the domain classifiers that registered array datasets name."""
    domains = {domain_extractor(name) for name in array_dataset_names()} - {None}
    return ("inception", *sorted(domains))


EXTRACTOR_NAMES = extractor_names()  # the registry's built-in datasets (visattn/data/sets)


def build_extractor(
    name: str,
    weights: str | Path | None = None,
    device: str | torch.device = "cpu",
    cache_dir: str | Path | None = None,
    data_root: str | Path | None = None,
) -> FeatureExtractor:
    """``inception`` (torch-fidelity's port; ``weights`` = its local weights file) or a domain
    classifier ``digits`` / ``fashion_mnist`` (``weights`` = a trained file; else trained once on
    the dataset found at ``data_root`` and cached under ``cache_dir``)."""
    if name == "inception":
        extractor: FeatureExtractor = inception.InceptionExtractor(weights)
    elif name in extractor_names():
        extractor = domain.load_domain_extractor(name, weights=weights, cache_dir=cache_dir, root=data_root)
    else:
        raise ValueError(f"extractor {name!r} is not known; use one of {', '.join(EXTRACTOR_NAMES)}")
    return extractor.to(device).eval()
