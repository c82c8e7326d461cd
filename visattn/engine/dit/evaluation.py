"""DiT evaluation: the model's description for results.json, sampling + scoring with the EMA model,
and the checkpoint loader of the sample / eval modes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import visattn
from visattn.engine.amp import apply_tf32, sampling_amp
from visattn.engine.checkpoints import (
    EMA_WEIGHTS,
    resolve_checkpoint,
)
from visattn.engine.distributed import (
    DistInfo,
    broadcast_object,
)
from visattn.engine.dit.data import build_codec
from visattn.engine.dit.sampling import agreement_labels, all_labels, build_scorer, generate_all, save_samples
from visattn.engine.dit.setup import build_diffusion, build_model, sample_settings
from visattn.engine.preempt import StopSignal
from visattn.engine.results import (
    Throughput,
    count_params,
    model_flops,
)
from visattn.models.dit import DiT
from visattn.utils.checkpoint import load_weights
from visattn.utils.flops import active_head_flops

log = logging.getLogger(__name__)


def run_info(model: nn.Module, cfg: Mapping[str, Any], dist: DistInfo) -> dict[str, Any]:
    """results.json fields that describe the model: executed FLOPs (eval mode) and active-head FLOPs
    (``visattn.utils.flops.active_head_flops``) of one image at one denoising step."""
    active, total = visattn.active_heads(model)
    shape = (1, model.in_channels, model.input_size, model.input_size)
    x = torch.zeros(shape, device=dist.device)
    t = torch.zeros(1, dtype=torch.long, device=dist.device)
    y = torch.zeros(1, dtype=torch.long, device=dist.device)
    return {
        "task": "dit",
        "attn": model.attn_name,
        "preset": cfg["dit"]["preset"],
        "seed": int(cfg["seed"]),
        "active_heads": [active, total],
        "active_ratio": active / total if total else None,
        "params": count_params(model),
        "flops_per_image": model_flops(model, x, t, y),
        "active_head_flops_per_image": active_head_flops(model, x, t, y),
    }


def evaluate_model(
    model: nn.Module, cfg: Mapping[str, Any], dist: DistInfo, run_dir: Path, scorer, save: bool,
    stop: StopSignal | None = None, step: int = 0,
) -> dict[str, Any]:
    """Sample ``eval.num_samples`` images with ``model`` on every rank and score them on rank 0.
    Returns (on every rank) the scores and what they were measured with. ``stop``: a stop signal ends
    the sampling with ``Preempted`` at ``step`` (the checkpoint that holds ``model``)."""
    num_samples = int(cfg["eval"]["num_samples"])
    decode = build_codec(cfg, dist.device)
    settings = sample_settings(cfg)
    timer = Throughput(dist.device)
    timer.start()
    diffusion = build_diffusion(cfg, model.learn_sigma).respace(cfg["sample"]["steps"])
    images = generate_all(model, diffusion, decode, settings, dist, num_samples, run_dir,
                          progress=bool(cfg["train"]["progress"]), stop=stop, step=step)
    timer.stop(num_samples)
    scores: dict[str, Any] = {}
    if dist.is_main:
        labels = all_labels(settings, num_samples, model.num_classes)
        if save:
            save_samples(run_dir, images, int(cfg["sample"]["grid"]), labels=labels)
        scorer, reference = scorer
        scores = scorer.score(images, reference, labels=agreement_labels(cfg, labels))
        log.info("%d samples (%s extractor): %s", num_samples, scores.get("extractor", "?"), ", ".join(
            f"{key} {scores[key]:.4g}" for key in ("fid", "sfid", "is", "precision", "recall", "class_agreement")
            if isinstance(scores.get(key), float)))
        scores.update({
            **sampling_record(settings, dist.device),
            "cfg_scale": float(settings["cfg_scale"]),
            "guided_channels": settings.get("guided_channels"),
            "sampling_steps": diffusion.num_timesteps,
            "sampler": settings["sampler"],
            "clip_denoised": settings["clip_denoised"],
            "eval_images_per_s": timer.rate,
        })
    return broadcast_object(scores)


def sampling_record(settings: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """How the samples were computed, for results.json: the model's precision and compile setting."""
    return {"sample_amp": sampling_amp(settings.get("amp", "auto"), device),
            "sample_compile": settings.get("compile", False)}


def load_for_sampling(cfg: Mapping[str, Any], device: torch.device) -> DiT:
    """The model of ``ckpt`` (its EMA weights when the file holds both), strictly."""
    ckpt = cfg.get("ckpt")
    if not ckpt:
        raise ValueError("mode=sample / mode=eval need ckpt=PATH (a run dir, a checkpoint folder "
                         "RUN_DIR/checkpoints/step-N, an ema.safetensors or an original DiT .pt)")
    model = build_model(cfg)
    if Path(ckpt).is_dir():  # a run dir or a checkpoint folder: its EMA weights
        found = resolve_checkpoint(ckpt)
        log.info("sampling with the EMA weights of %s (step %d)", found.path, found.step)
        state = found.weights(EMA_WEIGHTS)
    else:
        state = load_weights(ckpt, prefer_ema=True)
    if any(".wg" in k for k in state):
        state = visattn.convert_moh_state_dict(state)
    model.load_state_dict(state, strict=True)
    return model.to(device).eval()


def sample_mode(cfg: Mapping[str, Any], dist: DistInfo, run_dir: Path, stop: StopSignal | None = None) -> dict[str, Any]:
    tf32 = apply_tf32(bool(cfg["train"].get("tf32", True)), dist.device)
    model = load_for_sampling(cfg, dist.device)
    settings = sample_settings(cfg)
    num_samples = int(settings["num_samples"])
    diffusion = build_diffusion(cfg, model.learn_sigma).respace(settings["steps"])
    decode = build_codec(cfg, dist.device)
    timer = Throughput(dist.device)
    timer.start()
    images = generate_all(
        model, diffusion, decode, settings, dist, num_samples, run_dir,
        progress=bool(cfg["train"]["progress"]), stop=stop,
    )
    timer.stop(num_samples)
    if not dist.is_main:
        return {}
    labels = all_labels(settings, num_samples, model.num_classes)
    path = save_samples(run_dir, images, int(settings["grid"]), labels=labels)
    # images/s of the whole set (every process's samples, the decoder and the first call's compile included)
    return {"samples": str(path), "num_samples": num_samples, "tf32": tf32, "sample_images_per_s": timer.rate,
            "sampling_steps": diffusion.num_timesteps, **sampling_record(settings, dist.device)}


def eval_mode(cfg: Mapping[str, Any], dist: DistInfo, run_dir: Path, stop: StopSignal | None = None) -> dict[str, Any]:
    tf32 = apply_tf32(bool(cfg["train"].get("tf32", True)), dist.device)
    model = load_for_sampling(cfg, dist.device)
    scorer = build_scorer(cfg) if dist.is_main else None
    results = {**run_info(model, cfg, dist), "tf32": tf32}
    results.update(evaluate_model(model, cfg, dist, run_dir, scorer, save=True, stop=stop))
    results["attention_paths"] = visattn.attention.impl_choices(model)  # after the evaluation's forwards
    return results
