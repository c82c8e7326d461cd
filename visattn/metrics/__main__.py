"""``python -m visattn.metrics SAMPLES.npz REF.npz [--extractor inception|digits|fashion_mnist]``.

Prints ``{"fid", "sfid", "is", "precision", "recall", "class_agreement", "extractor", ...}`` as JSON.
SAMPLES.npz: ``arr_0`` uint8 [N, H, W, C]; its ``arr_1`` (or ``labels``) int [N], the conditioning
classes, give ``class_agreement`` (domain extractors only).
"""

from __future__ import annotations

import argparse
import json
import logging

from visattn.utils.allocator import tune_glibc_malloc
from visattn.utils.checks import int_at_least

from .extractor import EXTRACTOR_NAMES, build_extractor
from .reference import load_samples
from .scorer import GenerationScorer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m visattn.metrics", description=__doc__.splitlines()[0])
    parser.add_argument("samples", help="ADM .npz of generated images (arr_0: uint8 [N, H, W, C]; "
                                        "arr_1 or labels: int [N] conditioning classes, for class agreement)")
    parser.add_argument("reference", help="ADM .npz reference batch (arr_0, optionally mu/sigma/mu_s/sigma_s)")
    parser.add_argument("--extractor", default="inception", choices=EXTRACTOR_NAMES)
    parser.add_argument("--weights", default=None, help="extractor weights file (Inception: torch-fidelity's .pth)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int_at_least(1), default=64)
    parser.add_argument("--cache-dir", default=None, help="where domain extractors are cached (default $VISATTN_CACHE)")
    parser.add_argument("--data-root", default=None, help="dataset folder for training a domain extractor (fashion_mnist)")
    args = parser.parse_args(argv)

    tune_glibc_malloc()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] %(message)s")
    images, labels = load_samples(args.samples)  # before the extractor: a bad file fails at once
    extractor = build_extractor(
        args.extractor, weights=args.weights, device=args.device, cache_dir=args.cache_dir, data_root=args.data_root
    )
    scorer = GenerationScorer(extractor, batch_size=args.batch_size, progress=True)
    result = scorer.score(images, args.reference, labels=labels)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
