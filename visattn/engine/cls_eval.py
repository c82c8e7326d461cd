"""Classification evaluation: top-1/top-5 over the held-out set (exact under DDP), throughput,
and the per-class head load of routed models (``head_load.json``)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from visattn.attention import attention_modules

from .distributed import all_reduce_sum
from .results import Throughput


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


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    num_classes: int,
    amp_dtype: torch.dtype | None = None,
    head_load: HeadLoadMeter | None = None,
) -> dict[str, float]:
    """Top-1 / top-5 accuracy (fractions), mean cross-entropy and images/s over every rank's shard."""
    was_training = model.training
    model.eval()
    k = min(5, num_classes)
    totals = torch.zeros(4, device=device, dtype=torch.float64)  # correct@1, correct@k, loss sum, count
    timer = Throughput(device)
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        timer.start()
        with autocast:
            logits = model(images)
        timer.stop(len(labels))
        logits = logits.float()
        top = logits.topk(k, dim=1).indices
        hits = top.eq(labels.unsqueeze(1))
        totals += torch.stack([
            hits[:, 0].sum(), hits.any(dim=1).sum(), F.cross_entropy(logits, labels, reduction="sum"),
            torch.tensor(len(labels), device=device),
        ]).to(totals.dtype)
        if head_load is not None:
            head_load.update(labels)
    all_reduce_sum(totals)
    rate = all_reduce_sum(torch.tensor([timer.rate], device=device, dtype=torch.float64))
    model.train(was_training)
    count = max(totals[3].item(), 1.0)
    return {
        "top1": totals[0].item() / count,
        "top5": totals[1].item() / count,
        "eval_loss": totals[2].item() / count,
        "eval_images_per_s": rate.item(),
    }
