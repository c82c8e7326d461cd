"""torch-fidelity's TF-exact InceptionV3 port (``inception-v3-compat``) as a ``FeatureExtractor``.

Outputs match the ADM evaluator's graph tensors: ``pool_3`` (2048-d) for FID and precision/recall,
the bias-free logits ``pool_3 @ W`` (1008 classes) for IS, and ``mixed_6/conv`` for sFID: the output
of ``Mixed_6d.branch1x1`` (torch-fidelity's weight converter maps the one onto the other), of which
ADM keeps the first 7 channels of the 17x17 map, flattened channels-last (7 * 17 * 17 = 2023).
torch-fidelity resizes to 299 with TF1's bilinear (no antialias) and scales to [-1, 1] itself.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch
from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3, FeatureExtractorInceptionV3

from visattn.utils.checkpoint import load_weights

from .extractor_base import FeatureExtractor

INCEPTION_WEIGHTS_NAME = URL_INCEPTION_V3.rsplit("/", 1)[-1]  # weights-inception-2015-12-05-6726825d.pth
INCEPTION_WEIGHTS_ENV = "VISATTN_INCEPTION_WEIGHTS"
SPATIAL_CHANNELS = 7  # ADM: mixed_6/conv[..., :7]


def inception_weight_candidates(weights: str | Path | None = None) -> list[Path]:
    """Where the weights are looked for, in order: the given path, ``$VISATTN_INCEPTION_WEIGHTS``,
    torch hub's checkpoint cache (where torch-fidelity itself caches its download)."""
    candidates = [Path(weights)] if weights else []
    if os.environ.get(INCEPTION_WEIGHTS_ENV):
        candidates.append(Path(os.environ[INCEPTION_WEIGHTS_ENV]))
    candidates.append(Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_WEIGHTS_NAME)
    return candidates


def resolve_inception_weights(weights: str | Path | None = None) -> Path:
    """The first existing weights file; an explicitly given path must exist itself."""
    candidates = inception_weight_candidates(weights)
    if weights and not candidates[0].is_file():
        candidates = candidates[:1]
    for path in candidates:
        if path.is_file():
            return path
    looked = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(
        f"Inception weights {INCEPTION_WEIGHTS_NAME} not found (looked in: {looked}). Nothing is downloaded "
        f"at run time: fetch {URL_INCEPTION_V3} on a machine with network, then pass its path "
        f"(--weights PATH / the metrics config), set {INCEPTION_WEIGHTS_ENV}=PATH, or put it in "
        f"{Path(torch.hub.get_dir()) / 'checkpoints'}/."
    )


class InceptionExtractor(FeatureExtractor):
    """``forward(images: uint8 [B, H, W, C])`` -> ``(pool3 [B, 2048], mixed_6/conv [B, 2023], logits [B, 1008])``."""

    name = "inception"

    def __init__(self, weights: str | Path | None = None):
        super().__init__()
        state_dict = load_weights(resolve_inception_weights(weights))
        # torch-fidelity unpickles its weights with weights_only=False; hand it tensors we loaded
        # safely and re-serialised, never the outside file itself.
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        buffer.seek(0)
        self.net = FeatureExtractorInceptionV3(
            "inception-v3-compat", ["2048", "logits_unbiased"], feature_extractor_weights_path=buffer
        )

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = images.permute(0, 3, 1, 2)
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        captured: list[torch.Tensor] = []
        hook = self.net.Mixed_6d.branch1x1.register_forward_hook(
            lambda _module, _inputs, output: captured.append(output[:, :SPATIAL_CHANNELS].clone())
        )
        try:
            pooled, logits = self.net(x.contiguous())
        finally:
            hook.remove()
        spatial = captured[0].permute(0, 2, 3, 1).flatten(1)  # channels-last, as ADM reshapes NHWC
        return pooled, spatial, logits
