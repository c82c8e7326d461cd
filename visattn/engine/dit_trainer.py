"""DiT training, sampling and evaluation (``train_dit.py``'s modes), driven by the resolved config.

Modes: ``train`` (AdamW at a constant lr, EMA of the weights, hybrid diffusion loss + beta * MoH
load-balancing loss, DDP under torchrun, atomic resumable checkpoints, then sample and score with
the EMA model), ``sample`` (N images with one seed per sample index -> ``samples.npz`` + grid PNG),
``eval`` (sample + score -> ``results.json``) and ``cache_latents`` (pre-encode a dataset with the
SD VAE). Pixel-space runs (``vae=none``) work on in-memory images in [-1, 1]; latent runs read the
latent cache (``data.latents``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

import visattn
from visattn.data.latents import PixelData, pad_to, read_latent_cache
from visattn.data.loaders import train_sampler
from visattn.data.sources import class_names, load_arrays
from visattn.diffusion import GaussianDiffusion, conditional_fn
from visattn.engine.checkpoints import (
    CHECKPOINT_DIR,
    EMA_WEIGHTS,
    MODEL_WEIGHTS,
    Checkpoint,
    latest_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from visattn.engine.cls_eval import HeadLoadMeter
from visattn.engine.distributed import (
    DistInfo,
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_module,
    broadcast_object,
)
from visattn.engine.dit_sampling import EMBEDDED_DATASETS, build_scorer, generate_all, save_samples
from visattn.engine.ema import ModelEMA, unwrap_model
from visattn.engine.guard import NonFiniteError, NonFiniteGuard, cause_hint, require_finite
from visattn.engine.launch import launched, seed_everything
from visattn.engine.preempt import Preempted, StopSignal
from visattn.engine.results import (
    Throughput,
    count_params,
    model_flops,
    peak_memory_mb,
    write_json,
    write_results,
)
from visattn.engine.runlog import MetricsLogger
from visattn.engine.step import StepGate, clip_and_norm
from visattn.models.dit import DiT, create_dit
from visattn.utils.checkpoint import load_weights, rng_state, set_rng_state

log = logging.getLogger(__name__)

HEAD_LOAD_FILE = "head_load.json"


# --- model and data --------------------------------------------------------------------------------

def uses_vae(cfg: Mapping[str, Any]) -> bool:
    name = cfg["vae"]["name"]
    if name not in ("none", "sd"):
        raise ValueError(f"vae.name={name!r} is not known; use vae=none (pixel space) or vae=sd")
    return name == "sd"


def pixel_canvas(cfg: Mapping[str, Any]) -> int:
    """Side of the images the model sees in pixel space: ``dit.image_size`` (centre padding, e.g.
    Fashion-MNIST 28 -> 32) or the data's own size."""
    return int(cfg["dit"].get("image_size") or cfg["data"]["image_size"])


def model_geometry(cfg: Mapping[str, Any]) -> dict[str, int]:
    """input_size / in_channels / num_classes of the DiT for this data and codec."""
    data = cfg["data"]
    if uses_vae(cfg):
        down = int(cfg["vae"]["downsample"])
        if data["image_size"] % down:
            raise ValueError(f"data.image_size={data['image_size']} must be a multiple of the VAE's downsampling {down}")
        return {"input_size": data["image_size"] // down, "in_channels": int(cfg["vae"]["latent_channels"]),
                "num_classes": int(data["num_classes"])}
    return {"input_size": pixel_canvas(cfg), "in_channels": int(data["in_chans"]), "num_classes": int(data["num_classes"])}


def attention_override(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``attn`` group, when chosen on the command line, replaces the preset's attention."""
    attn = cfg.get("attn")
    return dict(attn) if attn else None


def build_model(cfg: Mapping[str, Any]) -> DiT:
    dit = cfg["dit"]
    overrides = {**model_geometry(cfg), **dict(dit.get("overrides") or {})}
    overrides["class_dropout_prob"] = float(dit["class_dropout_prob"])
    overrides["learn_sigma"] = bool(dit["learn_sigma"])
    attn = attention_override(cfg)
    if attn is not None:
        overrides["attn"] = attn
    return create_dit(dit["preset"], **overrides)


def build_diffusion(cfg: Mapping[str, Any], learn_sigma: bool) -> GaussianDiffusion:
    diffusion = cfg["diffusion"]
    if diffusion["schedule"] != "linear":
        raise ValueError(f"diffusion.schedule={diffusion['schedule']!r} is not known; use linear")
    return GaussianDiffusion.linear(int(diffusion["timesteps"]), learn_sigma)


def load_pixel_arrays(cfg: Mapping[str, Any], split: str) -> tuple[np.ndarray, np.ndarray]:
    data = cfg["data"]
    if data["name"] not in EMBEDDED_DATASETS:
        raise ValueError(
            f"data={data['name']} has no in-memory pixel loader for DiT; use one of {EMBEDDED_DATASETS} in pixel "
            f"space, or vae=sd with a latent cache (mode=cache_latents)"
        )
    return load_arrays(data["name"], split, data.get("root"))


def build_train_data(cfg: Mapping[str, Any]):
    flip = bool(cfg["train"]["flip"])
    if uses_vae(cfg):
        path = cfg["data"].get("latents")
        if not path:
            raise ValueError(
                "vae=sd trains on a latent cache: set data.latents=DIR (create it with "
                "`python train_dit.py mode=cache_latents vae=sd data=... data.latents=DIR`)"
            )
        return read_latent_cache(path, flip=flip)
    images, labels = load_pixel_arrays(cfg, "train")
    return PixelData(pad_to(images, pixel_canvas(cfg)), labels, flip=flip)


def build_codec(cfg: Mapping[str, Any], device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Model space [B, C, h, w] -> images in [-1, 1] [B, C, H, W] at the data's size."""
    if uses_vae(cfg):
        from visattn.models.vae import load_sd_vae

        vae = cfg["vae"]
        codec = load_sd_vae(vae.get("path"), vae["repo"], float(vae["scale"]), device=device)
        return codec.decode
    size = int(cfg["data"]["image_size"])

    def crop(x: torch.Tensor) -> torch.Tensor:
        top = (x.shape[-1] - size) // 2
        return x[..., top : top + size, top : top + size]

    return crop


def sample_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg.sample`` with ``clip_denoised`` resolved: ``null`` = clip the predicted x_0 to [-1, 1]
    in pixel space (ADM's choice for images), not in latent space (DiT's: latents are unbounded)."""
    sample = dict(cfg["sample"])
    if sample.get("clip_denoised") is None:
        sample["clip_denoised"] = not uses_vae(cfg)
    return sample


def autocast_context(cfg: Mapping[str, Any], device: torch.device):
    """bf16 autocast on CUDA (``train.amp=auto``), none on CPU unless asked for. (No fp16: it would
    need loss scaling, and bf16 is what the GPUs we target run.)"""
    amp = cfg["train"]["amp"]
    if amp == "auto":
        amp = "bf16" if device.type == "cuda" else "none"
    if amp not in ("bf16", "none"):
        raise ValueError(f"train.amp={amp!r} is not known; use auto, bf16 or none")
    return nullcontext() if amp == "none" else torch.autocast(device.type, dtype=torch.bfloat16)


# --- training ---------------------------------------------------------------------------------------

class EpochBatches:
    """This rank's batches of indices: a shuffled shard per epoch (deterministic in seed and epoch),
    last partial batch dropped. ``epoch`` and ``taken`` (batches of that epoch already used) are
    checkpointed, so a resumed run continues the same stream."""

    def __init__(self, size: int, batch_size: int, dist: DistInfo, seed: int) -> None:
        self.sampler = train_sampler(range(size), dist.rank, dist.world_size, seed)
        self.batch_size = batch_size
        if len(self.sampler) < batch_size:
            raise ValueError(
                f"per-rank batch {batch_size} is larger than this rank's share of the data ({len(self.sampler)}); "
                f"lower train.batch_size"
            )
        self.epoch = 0
        self.taken = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            self.sampler.set_epoch(self.epoch)
            order = torch.tensor(list(self.sampler), dtype=torch.long)
            n_batches = len(order) // self.batch_size
            while self.taken < n_batches:
                start = self.taken * self.batch_size
                self.taken += 1
                yield order[start : start + self.batch_size]
            self.epoch += 1
            self.taken = 0


def save_training_checkpoint(
    run_dir: Path, model: nn.Module, ema: ModelEMA, opt, step: int, batches: EpochBatches, dist: DistInfo,
    guard: NonFiniteGuard, extra: Mapping[str, Any] | None = None,
) -> None:
    """One checkpoint unit (``checkpoints/step-N/``: model + EMA weights, optimizer, step, data
    position, every rank's RNG, the guard's counts and ``extra``, e.g. fid_step0); rank 0 writes.
    Non-finite weights are refused on every rank before anything is written."""
    weights = {MODEL_WEIGHTS: unwrap_model(model).state_dict(), EMA_WEIGHTS: ema.state_dict()}
    for name, tensors in weights.items():
        require_finite(tensors, name, step)
    rngs = all_gather_object(rng_state())
    if dist.is_main:
        save_checkpoint(run_dir, step, weights, {
            "optimizer": opt.state_dict(),
            "step": step,
            "data_position": [batches.epoch, batches.taken],
            "rng": rngs,
            "guard": guard.state_dict(),
            "extra": dict(extra or {}),
        })
    barrier()


def restore_training_checkpoint(
    found: Checkpoint, model: nn.Module, ema: ModelEMA, opt, batches: EpochBatches, dist: DistInfo,
    guard: NonFiniteGuard,
) -> tuple[int, dict[str, Any]]:
    """Load what ``save_training_checkpoint`` wrote; returns (step, extra)."""
    state = found.state()
    unwrap_model(model).load_state_dict(found.weights(MODEL_WEIGHTS))
    ema.load_state_dict(found.weights(EMA_WEIGHTS))
    opt.load_state_dict(state["optimizer"])
    guard.load_state_dict(state.get("guard"))
    batches.epoch, batches.taken = (int(v) for v in state["data_position"])
    rngs = state["rng"]
    if len(rngs) == dist.world_size:
        set_rng_state(rngs[dist.rank])
    else:
        log.warning("checkpoint has RNG states of %d ranks, this run has %d: RNG not restored", len(rngs), dist.world_size)
    return int(state["step"]), dict(state.get("extra", {}))


def checkpoint_to_resume(resume: Any, run_dir: Path) -> Checkpoint | None:
    """``resume``: false -> None; auto -> the run dir's newest checkpoint if any; true -> it must exist."""
    if resume is False or resume is None:
        return None
    found = latest_checkpoint(run_dir)
    if found is None and resume != "auto":
        raise FileNotFoundError(f"resume={resume}: {run_dir / CHECKPOINT_DIR} holds no complete checkpoint; use "
                                "resume=auto to start afresh when there is none, or hydra.run.dir=RUN_DIR of a run")
    return found


def run_info(model: nn.Module, cfg: Mapping[str, Any], dist: DistInfo) -> dict[str, Any]:
    """results.json fields that describe the model."""
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
    }


def train(cfg: Mapping[str, Any], dist: DistInfo, run_dir: Path, stop: StopSignal) -> dict[str, Any]:
    tcfg = cfg["train"]
    seed = int(cfg["seed"])
    seed_everything(seed * 1000)
    data = build_train_data(cfg)
    model = build_model(cfg).to(dist.device)
    broadcast_module(model)  # every rank starts from rank 0's weights, before the EMA copies them
    if dist.rank:
        seed_everything(seed * 1000 + dist.rank)  # label dropout, flips, t and noise differ per rank
    if tuple(data.sample_shape) != (model.in_channels, model.input_size, model.input_size):
        raise ValueError(f"data samples are {tuple(data.sample_shape)} but the model takes "
                         f"{(model.in_channels, model.input_size, model.input_size)}; check data/vae settings")
    diffusion = build_diffusion(cfg, model.learn_sigma)
    ema = ModelEMA(model, float(tcfg["ema_decay"]))
    opt = torch.optim.AdamW(model.parameters(), lr=float(tcfg["lr"]), weight_decay=float(tcfg["weight_decay"]))
    global_batch = int(tcfg["batch_size"])
    if global_batch % dist.world_size:
        raise ValueError(f"train.batch_size={global_batch} is not divisible by the {dist.world_size} processes")
    batches = EpochBatches(len(data), global_batch // dist.world_size, dist, seed)
    info = run_info(model, cfg, dist)
    log.info("%s: %.2fM parameters, %d/%d heads active, %d training images",
             cfg["dit"]["preset"], info["params"] / 1e6, *info["active_heads"], len(data))

    guard = NonFiniteGuard(int(tcfg["max_nonfinite_steps"]),
                           cause_hint(float(tcfg["lr"]), str(tcfg["amp"]), cfg["data"]["name"]))
    step = 0
    results: dict[str, Any] = {}
    found = checkpoint_to_resume(cfg.get("resume"), run_dir)
    if found is not None:
        step, extra = restore_training_checkpoint(found, model, ema, opt, batches, dist, guard)
        results.update(extra)
        log.info("resumed from %s at step %d", found.path, step)
    metrics = MetricsLogger(run_dir, tensorboard=bool(tcfg.get("tensorboard", True)), enabled=dist.is_main)
    metrics.drop_after(step)

    scorer = build_scorer(cfg) if cfg["eval"]["enabled"] and dist.is_main else None
    if step == 0 and cfg["eval"]["enabled"] and cfg["eval"]["fid_step0"]:
        scores = evaluate_model(ema.module, cfg, dist, run_dir, scorer, save=False)
        if dist.is_main:
            results["fid_step0"] = scores["fid"]
            log.info("step 0: FID %.2f", scores["fid"])

    ddp = DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None) \
        if dist.distributed else model
    model.train()
    total_steps = int(tcfg["steps"])
    aux_weight = float(tcfg["aux_loss_weight"])
    autocast = autocast_context(cfg, dist.device)
    gate = StepGate(guard, stop, dist.device)
    timer = Throughput(dist.device)
    stream = iter(batches)
    running = torch.zeros(3, device=dist.device)  # loss, aux, count since the last log
    t_start = time.perf_counter()
    bar = tqdm(total=total_steps, initial=step, desc="train", disable=not dist.is_main, dynamic_ncols=True)
    while step < total_steps:
        timer.start()
        x, y = data.batch(next(stream))
        x, y = x.to(dist.device, non_blocking=True), y.to(dist.device, non_blocking=True)
        t = torch.randint(0, diffusion.num_timesteps, (x.shape[0],), device=dist.device)
        with autocast:
            terms = diffusion.training_losses(conditional_fn(ddp, y), x, t)
            diffusion_loss = terms["loss"].mean()
            aux = visattn.aux_loss(model)
            loss = diffusion_loss + aux_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = clip_and_norm(model.parameters(), tcfg.get("clip_grad"))
        apply, stop_now = gate.decide(step, loss, norm)
        if apply:
            opt.step()
            ema.update(model)
        timer.stop(x.shape[0] * dist.world_size)
        step += 1
        if apply:
            running += torch.stack([diffusion_loss.detach().float(), aux.detach().float(),
                                    torch.ones((), device=dist.device)])
        bar.update(1)
        if step % int(tcfg["log_every"]) == 0 or step == total_steps:
            loss_mean, aux_mean, count = all_reduce_sum(running).tolist()
            loss_mean, aux_mean = (loss_mean / count, aux_mean / count) if count else (math.nan, math.nan)
            running.zero_()
            row = {"step": step, "epoch": batches.epoch, "loss": loss_mean, "aux_loss": aux_mean,
                   "lr": opt.param_groups[0]["lr"], "images_per_s": timer.rate, "skipped_steps": guard.skipped}
            metrics.log(row)
            bar.set_postfix(loss=f"{loss_mean:.4f}", aux=f"{aux_mean:.3f}")
        if step % int(tcfg["ckpt_every"]) == 0 or step == total_steps or stop_now:
            save_training_checkpoint(run_dir, model, ema, opt, step, batches, dist, guard, extra=results)
        if stop_now:
            bar.close()
            metrics.close()
            raise stop.preempted(step)
    bar.close()
    metrics.close()
    train_seconds = time.perf_counter() - t_start
    results.update(info)
    results.update({"train_steps": step, "train_images_per_s": timer.rate, "train_wall_time_s": train_seconds,
                    "skipped_steps": guard.skipped})
    active, total = info["active_heads"]
    if active < total:  # as in classification: only models that select heads per token have a load
        load = measure_head_load(ema.module, data, diffusion, cfg, dist)
        if dist.is_main:
            write_json(run_dir / HEAD_LOAD_FILE, load)
    if cfg["eval"]["enabled"]:
        results.update(evaluate_model(ema.module, cfg, dist, run_dir, scorer, save=True))
    return results


# --- head load -------------------------------------------------------------------------------------

@torch.no_grad()
def measure_head_load(model: nn.Module, data, diffusion: GaussianDiffusion, cfg: Mapping[str, Any], dist: DistInfo):
    """``head_load.json`` content: per layer and class, the fraction of tokens that used each head,
    over the first ``eval.head_load_images`` training examples noised at seeded random steps."""
    meter = HeadLoadMeter(model, model.num_classes, dist.device)
    n = min(len(data), int(cfg["eval"]["head_load_images"]))
    indices = torch.arange(dist.rank, n, dist.world_size)
    gen = torch.Generator().manual_seed(int(cfg["seed"]))
    model.eval()
    with torch.random.fork_rng(devices=[]):  # data.batch draws flips / posterior noise: keep training's RNG
        for chunk in indices.split(int(cfg["sample"]["batch_size"])):
            x, y = data.batch(chunk)
            t = torch.randint(0, diffusion.num_timesteps, (len(chunk),), generator=gen)
            x_t = diffusion.q_sample(x, t, torch.randn(x.shape, generator=gen))
            model(x_t.to(dist.device), t.to(dist.device), y.to(dist.device))
            meter.update(y.to(dist.device))
    return meter.reduce(class_names(cfg["data"]["name"], int(cfg["data"]["num_classes"])))


# --- evaluation -------------------------------------------------------------------------------------

def evaluate_model(
    model: nn.Module, cfg: Mapping[str, Any], dist: DistInfo, run_dir: Path, scorer, save: bool
) -> dict[str, Any]:
    """Sample ``eval.num_samples`` images with ``model`` on every rank and score them on rank 0.
    Returns (on every rank) the scores and what they were measured with."""
    num_samples = int(cfg["eval"]["num_samples"])
    decode = build_codec(cfg, dist.device)
    settings = sample_settings(cfg)
    timer = Throughput(dist.device)
    timer.start()
    diffusion = build_diffusion(cfg, model.learn_sigma).respace(cfg["sample"]["steps"])
    images = generate_all(model, diffusion, decode, settings, dist, num_samples, run_dir)
    timer.stop(num_samples)
    scores: dict[str, Any] = {}
    if dist.is_main:
        if save:
            save_samples(run_dir, images, int(cfg["sample"]["grid"]))
        scorer, reference = scorer
        scores = scorer.score(images, reference)
        scores.update({
            "cfg_scale": float(settings["cfg_scale"]),
            "guided_channels": settings.get("guided_channels"),
            "sampling_steps": diffusion.num_timesteps,
            "sampler": settings["sampler"],
            "clip_denoised": settings["clip_denoised"],
            "eval_images_per_s": timer.rate,
        })
    return broadcast_object(scores)


# --- the modes --------------------------------------------------------------------------------------

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


def sample_mode(cfg: Mapping[str, Any], dist: DistInfo, run_dir: Path) -> dict[str, Any]:
    model = load_for_sampling(cfg, dist.device)
    num_samples = int(cfg["sample"]["num_samples"])
    diffusion = build_diffusion(cfg, model.learn_sigma).respace(cfg["sample"]["steps"])
    images = generate_all(
        model, diffusion, build_codec(cfg, dist.device), sample_settings(cfg), dist, num_samples, run_dir
    )
    if not dist.is_main:
        return {}
    path = save_samples(run_dir, images, int(cfg["sample"]["grid"]))
    return {"samples": str(path), "num_samples": num_samples}


def eval_mode(cfg: Mapping[str, Any], dist: DistInfo, run_dir: Path) -> dict[str, Any]:
    model = load_for_sampling(cfg, dist.device)
    scorer = build_scorer(cfg) if dist.is_main else None
    results = run_info(model, cfg, dist)
    results.update(evaluate_model(model, cfg, dist, run_dir, scorer, save=True))
    return results


def cache_latents_mode(cfg: Mapping[str, Any], dist: DistInfo, run_dir: Path) -> dict[str, Any]:
    """Encode the training split with the SD VAE into ``data.latents`` (single process)."""
    from visattn.data.latents import to_unit_range, write_latent_cache
    from visattn.models.vae import load_sd_vae

    out = cfg["data"].get("latents")
    if not out:
        raise ValueError("mode=cache_latents needs data.latents=DIR (where the shards go)")
    vae_cfg = cfg["vae"]
    vae = load_sd_vae(vae_cfg.get("path"), vae_cfg["repo"], float(vae_cfg["scale"]), device=dist.device)
    rgb = vae.autoencoder.config.in_channels == 3
    images, labels = image_source(cfg)
    if cfg["cache"].get("max_images"):
        labels = labels[: int(cfg["cache"]["max_images"])]
    batch = int(cfg["cache"]["batch_size"])

    def batches():
        for start in tqdm(range(0, len(labels), batch), desc="encoding"):
            x = to_unit_range(torch.from_numpy(np.ascontiguousarray(images[start : start + batch])))
            if rgb and x.shape[1] == 1:
                x = x.expand(-1, 3, -1, -1)
            yield x.to(dist.device), torch.from_numpy(np.asarray(labels[start : start + batch]))

    meta = {"data": cfg["data"]["name"], "image_size": int(cfg["data"]["image_size"])}
    paths = write_latent_cache(out, batches(), vae.encode_moments, vae.scale, int(cfg["cache"]["shard_size"]), meta)
    return {"latents": str(out), "shards": len(paths), "images": int(len(labels))}


def image_source(cfg: Mapping[str, Any]) -> tuple[Any, np.ndarray]:
    """Training images uint8 [S, S, C] at data.image_size for the latent cache, indexable, and their
    labels: embedded datasets centre-padded; an ImageNet-style folder through ADM's centre crop."""
    data = cfg["data"]
    size = int(data["image_size"])
    if data["name"] == "imagefolder":
        from torchvision.datasets import ImageFolder

        from visattn.metrics import center_crop_arr

        folder = ImageFolder(Path(data["root"]) / "train", transform=lambda im: center_crop_arr(im.convert("RGB"), size))
        return _FirstItems(folder), np.asarray(folder.targets, dtype=np.int64)
    images, labels = load_pixel_arrays(cfg, "train")
    return pad_to(images, size), labels


class _FirstItems:
    """dataset[i][0] through slicing: ``view[a:b]`` -> stacked images of items a..b-1."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, items: slice) -> np.ndarray:
        return np.stack([self.dataset[i][0] for i in range(*items.indices(len(self.dataset)))])


MODES = {"train": train, "sample": sample_mode, "eval": eval_mode, "cache_latents": cache_latents_mode}


def run(cfg: Mapping[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """Run ``cfg.mode`` through the launch layer; rank 0 writes results.json (train / eval) and the
    results are returned. A preempted training raises ``Preempted`` and a diverged one
    ``NonFiniteError``, after writing results.json with ``completed: false`` and why."""
    mode = cfg["mode"]
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not known; use one of {tuple(MODES)}")
    with launched(cfg["device"], cfg["train"].get("num_threads"), run_dir) as ctx:
        dist, run_dir = ctx.dist, ctx.run_dir
        start = time.perf_counter()

        def finish(results: dict[str, Any]) -> dict[str, Any]:
            if dist.is_main and mode in ("train", "eval"):
                results.update({"wall_time_s": time.perf_counter() - start,
                                "peak_memory_mb": peak_memory_mb(dist.device), "config": dict(cfg)})
                write_results(run_dir, results)
            return results

        try:
            results = MODES[mode](cfg, dist, run_dir, ctx.stop) if mode == "train" else MODES[mode](cfg, dist, run_dir)
        except Preempted as stopped:
            finish({"task": "dit", "completed": False, "preempted": True, "train_steps": stopped.step})
            raise
        except NonFiniteError as err:
            finish({"task": "dit", "completed": False, "failure": err.failure})
            raise
        return finish({**results, "completed": True} if mode == "train" else results)
