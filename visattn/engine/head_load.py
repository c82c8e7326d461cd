"""Head load of routed attention (``head_load.json``): per layer and class, the fraction of tokens
that used each head. Both tasks fill it during a forward pass over labelled inputs."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from visattn.attention import attention_modules

from .distributed import all_reduce_sum

HEAD_LOAD_FILE = "head_load.json"


class HeadLoadMeter:
    """Per layer, the summed per-sample head-use fractions [classes, H] and the samples per class."""

    def __init__(self, model: nn.Module, num_classes: int, device: torch.device) -> None:
        self.layers = [m for _, m in attention_modules(model)]
        self.sums = [torch.zeros(num_classes, m.num_heads, device=device) for m in self.layers]
        self.counts = torch.zeros(num_classes, device=device)

    def update(self, labels: torch.Tensor) -> None:
        """After a forward of a batch with ``labels: [B]``: read each layer's ``head_load`` [B, H]."""
        for layer, total in zip(self.layers, self.sums, strict=True):
            load = getattr(layer, "stats", {}).get("head_load")
            if load is None:  # a layer that does not route uses every head
                load = torch.ones(len(labels), layer.num_heads, device=total.device)
            total.index_add_(0, labels, load.to(total.device, torch.float32))
        self.counts += torch.bincount(labels, minlength=len(self.counts)).float()

    def reduce(self, classes: list[str]) -> dict[str, Any]:
        """The ``head_load.json`` content (summed over ranks): load[layer][class][head]."""
        for total in self.sums:
            all_reduce_sum(total)
        all_reduce_sum(self.counts)
        denom = self.counts.clamp_min(1).unsqueeze(1)
        return {
            "classes": classes,
            "layers": len(self.layers),
            "heads": [m.num_heads for m in self.layers],
            "load": [(total / denom).tolist() for total in self.sums],
        }
