"""visattn hosts no weights: the one check that a ``pretrained=True`` timm model was given a local file."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from timm.models._builder import resolve_pretrained_cfg


def require_local_weights(variant: str, kwargs: Mapping[str, Any], accepted: str) -> None:
    """Raise before timm looks for weights: ValueError when no source is given (nothing is downloaded),
    FileNotFoundError naming the path when ``pretrained_cfg_overlay=dict(file=...)`` does not exist.

    ``kwargs``: the ``timm.create_model`` keywords; ``accepted``: the files this model loads, for the message.
    """
    cfg = resolve_pretrained_cfg(
        variant, pretrained_cfg=kwargs.get("pretrained_cfg"), pretrained_cfg_overlay=kwargs.get("pretrained_cfg_overlay")
    )
    usage = f"timm.create_model({variant!r}, pretrained=True, pretrained_cfg_overlay=dict(file=PATH))"
    if not (cfg.file or cfg.state_dict or cfg.url or cfg.hf_hub_id):
        raise ValueError(
            f"{variant} has no hosted weights and visattn downloads nothing; give a local checkpoint: "
            f"{usage} ({accepted})"
        )
    if cfg.file and not Path(cfg.file).is_file():
        raise FileNotFoundError(
            f"pretrained_cfg_overlay file={cfg.file!r} does not exist (for {variant}); give the path of a "
            f"local checkpoint: {usage} ({accepted})"
        )
