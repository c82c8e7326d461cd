"""Sampling a DiT into an ADM sample batch, and scoring it with ``visattn.metrics``.

Every sample index has its own seed (initial noise, step noise, label), so a set of N samples is
the same on any number of processes: rank r draws indices r, r + world, ... and rank 0 merges.
"""

from __future__ import annotations

import io
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from PIL import Image
from tqdm.auto import tqdm

from visattn.data.latents import to_uint8
from visattn.data.registry import domain_extractor, is_array_dataset
from visattn.diffusion import GaussianDiffusion, sample_generators, sample_loop, sampling_fn
from visattn.engine.amp import sampling_amp
from visattn.engine.distributed import DistInfo, barrier
from visattn.engine.preempt import StopSignal, stop_checked
from visattn.engine.step import compiled
from visattn.metrics import GenerationScorer, ReferenceBatch, build_extractor, dataset_images, save_npz_batch
from visattn.metrics.agreement import LABEL_EXTRACTORS
from visattn.utils.checkpoint import atomic_write_bytes

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.npz"
GRID_FILE = "samples.png"


def sample_labels(seed: int, indices: list[int], num_classes: int) -> torch.Tensor:
    """The class of each global sample index, a fixed function of (seed, index)."""
    gens = sample_generators(seed + 1, indices)
    return torch.tensor([int(torch.randint(num_classes, (), generator=g)) for g in gens], dtype=torch.long)


@torch.no_grad()
def generate(
    model: nn.Module,
    diffusion: GaussianDiffusion,
    decode: Callable[[torch.Tensor], torch.Tensor],
    indices: list[int],
    seed: int,
    sample_cfg: Mapping[str, Any],
    device: torch.device,
    progress: bool = False,
    stop: StopSignal | None = None,
    step: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Samples of the given global indices -> (uint8 [n, H, W, C], labels [n]).

    Each index has its own seed for the initial noise, every step's noise and its label, so the
    result does not depend on the batch or process that draws it. ``stop``: a stop signal ends the
    sampling after the current batch with ``Preempted`` at ``step`` (the checkpoint sampled from).
    ``sample_cfg["amp"]`` (``engine.amp.sampling_amp``) sets the precision of the model's forwards,
    ``sample_cfg["compile"]`` compiles the model for this call (``engine.step.compiled``); the
    diffusion's arithmetic and the decoder run in fp32.
    """
    model.eval()
    bf16 = sampling_amp(sample_cfg.get("amp", "auto"), device) == "bf16"
    forward = compiled(model, sample_cfg.get("compile", False), "sample.compile")
    shape = (model.in_channels, model.input_size, model.input_size)
    labels = sample_labels(seed, indices, model.num_classes)
    batch = int(sample_cfg["batch_size"])
    out = []
    starts = stop_checked(range(0, len(indices), batch), stop, step, device)
    for start in tqdm(starts, total=-(-len(indices) // batch), desc="sampling", disable=not progress):
        part = indices[start : start + batch]
        y = labels[start : start + batch].to(device)
        fn = sampling_fn(forward, y, float(sample_cfg["cfg_scale"]), sample_cfg.get("guided_channels"))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):  # the model's output is cast to fp32
            x = sample_loop(
                diffusion, fn, shape, sample_generators(seed, part, device), device,
                method=sample_cfg["sampler"], eta=float(sample_cfg.get("eta", 0.0)),
                clip_denoised=bool(sample_cfg.get("clip_denoised", False)),
            )
        out.append(to_uint8(decode(x)))
    images = np.concatenate(out) if out else np.zeros((0, 1, 1, 1), np.uint8)
    return images, labels.numpy()


def all_labels(sample_cfg: Mapping[str, Any], num_samples: int, num_classes: int) -> np.ndarray:
    """The conditioning class of every global sample index 0..N-1 (int64 [N]), as ``generate`` draws
    them with ``sample_cfg["seed"]``: the labels of ``generate_all``'s images, in index order."""
    return sample_labels(int(sample_cfg["seed"]), list(range(num_samples)), num_classes).numpy()


def generate_all(
    model: nn.Module, diffusion: GaussianDiffusion, decode, sample_cfg: Mapping[str, Any], dist: DistInfo,
    num_samples: int, run_dir: Path, progress: bool = True, stop: StopSignal | None = None, step: int = 0,
) -> np.ndarray | None:
    """All ``num_samples`` samples (uint8 [N, H, W, C]); rank r draws indices r, r + world, ...
    Under DDP each rank writes its part to the run dir and rank 0 merges them in index order
    (no all-gather of images through memory). Rank 0 gets the array, the others None."""
    indices = list(range(dist.rank, num_samples, dist.world_size))
    images, _ = generate(model, diffusion, decode, indices, int(sample_cfg["seed"]), sample_cfg,
                         dist.device, progress=progress and dist.is_main, stop=stop, step=step)
    if not dist.distributed:
        return images
    part = run_dir / f".samples-rank{dist.rank}.npy"
    buffer = io.BytesIO()
    np.save(buffer, images)
    atomic_write_bytes(part, buffer.getvalue())
    barrier()
    if not dist.is_main:
        barrier()
        return None
    merged = None
    for rank in range(dist.world_size):
        path = run_dir / f".samples-rank{rank}.npy"
        chunk = np.load(path)
        if merged is None:
            merged = np.empty((num_samples, *chunk.shape[1:]), dtype=chunk.dtype)
        merged[rank::dist.world_size] = chunk
        path.unlink()
    barrier()
    return merged


def save_samples(run_dir: Path, images: np.ndarray, grid: int, labels: np.ndarray | None = None) -> Path:
    """``samples.npz`` (ADM layout: arr_0 uint8 [N, H, W, C]; with ``labels``, arr_1 int64 [N], each
    sample's conditioning class) and a PNG grid of the first ``grid``."""
    path = run_dir / SAMPLES_FILE
    save_npz_batch(path, ReferenceBatch(images=images), labels=labels)
    n = min(grid, len(images))
    if n:
        cols = math.ceil(math.sqrt(n))
        rows = math.ceil(n / cols)
        _, h, w, c = images.shape
        gap = max(1, h // 16)  # a dark line between tiles, so small images stay apart
        canvas = np.zeros((rows * (h + gap) - gap, cols * (w + gap) - gap, c), dtype=np.uint8)
        for i in range(n):
            r, q = divmod(i, cols)
            canvas[r * (h + gap) : r * (h + gap) + h, q * (w + gap) : q * (w + gap) + w] = images[i]
        png = io.BytesIO()
        Image.fromarray(canvas[..., 0] if c == 1 else canvas).save(png, format="PNG")
        atomic_write_bytes(run_dir / GRID_FILE, png.getvalue())
    return path


def extractor_name(cfg: Mapping[str, Any]) -> str:
    """``eval.extractor``, or by data: the domain classifier for digits / fashion_mnist, Inception else."""
    name = cfg["eval"].get("extractor")
    if name:
        return name
    return domain_extractor(cfg["data"]["name"]) or "inception"


def agreement_labels(cfg: Mapping[str, Any], labels: np.ndarray) -> np.ndarray | None:
    """The conditioning labels to score class agreement with, or None where the extractor does not
    classify this data's classes: a domain classifier (e.g. digits) names its own 10 classes whatever
    the images are, so its agreement with the labels of other data would be a number without meaning."""
    name, data = extractor_name(cfg), cfg["data"]["name"]
    if name == domain_extractor(data):
        return labels
    if name in LABEL_EXTRACTORS:
        log.warning("eval.extractor=%s classifies %s images, not data=%s: class agreement is left out",
                    name, name, data)
    return None


def build_scorer(cfg: Mapping[str, Any]) -> tuple[Any, Any]:
    """(GenerationScorer, reference statistics): one extractor and the reference features, computed
    once and reused by every evaluation of the run. The reference is ``eval.reference`` (an ADM
    .npz) or the embedded dataset's ``eval.reference_split``."""
    ecfg = cfg["eval"]
    device = ecfg.get("extractor_device") or ("cuda" if torch.cuda.is_available() else "cpu")
    scorer = GenerationScorer(build_extractor(extractor_name(cfg), weights=ecfg.get("extractor_weights"), device=device))
    reference = ecfg.get("reference")
    if not reference:
        data = cfg["data"]
        if not is_array_dataset(data["name"]):
            raise ValueError(f"data={data['name']}: give eval.reference=REF.npz (an ADM reference batch) to score samples")
        reference = dataset_images(data["name"], ecfg["reference_split"], root=data.get("root"))
    return scorer, scorer.reference_stats(reference)
