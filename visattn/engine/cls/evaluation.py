"""Classification evaluation: top-1/top-5 over the held-out set (exact under DDP) and throughput;
the per-class head load of routed models is measured along (``head_load.HeadLoadMeter``)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from visattn.engine.distributed import all_reduce_sum
from visattn.engine.head_load import HeadLoadMeter
from visattn.engine.preempt import StopSignal, stop_checked
from visattn.engine.results import Throughput


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    num_classes: int,
    amp_dtype: torch.dtype | None = None,
    head_load: HeadLoadMeter | None = None,
    stop: StopSignal | None = None,
    step: int = 0,
) -> dict[str, float]:
    """Top-1 / top-5 accuracy (fractions), mean cross-entropy and images/s over every rank's shard.
    ``stop``: a stop signal ends the evaluation after the current batch with ``Preempted`` at ``step``
    (the checkpoint that holds these weights)."""
    was_training = model.training
    model.eval()
    k = min(5, num_classes)
    totals = torch.zeros(4, device=device, dtype=torch.float64)  # correct@1, correct@k, loss sum, count
    timer = Throughput(device)
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    for images, labels in stop_checked(loader, stop, step, device):
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
