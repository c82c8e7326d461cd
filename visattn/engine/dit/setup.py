"""DiT set-up from the resolved config: what the config means (pixel or latent space, the model's
geometry, the diffusion, the sampler settings) and ``validate_dit_config``, run before any work.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from visattn.data.registry import array_dataset_names, is_array_dataset
from visattn.diffusion import GaussianDiffusion
from visattn.diffusion.sampling import SAMPLERS
from visattn.diffusion.schedule import space_timesteps
from visattn.engine.amp import normalize_amp
from visattn.engine.moh_paths import check_attn_paths
from visattn.engine.optim import SCHEDULES
from visattn.engine.step import check_compile_setting
from visattn.metrics import GenerationScorer
from visattn.models.budgets import apply_budget
from visattn.models.dit import DiT, dit_preset_config
from visattn.utils.checks import require, require_count, require_positive

log = logging.getLogger(__name__)


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
    kwargs = dit_preset_config(dit["preset"], **overrides)
    return DiT(**apply_budget(kwargs, cfg.get("budget"), depth=kwargs["depth"], declared_only=True))


def build_diffusion(cfg: Mapping[str, Any], learn_sigma: bool) -> GaussianDiffusion:
    diffusion = cfg["diffusion"]
    if diffusion["schedule"] != "linear":
        raise ValueError(f"diffusion.schedule={diffusion['schedule']!r} is not known; use linear")
    return GaussianDiffusion.linear(
        int(diffusion["timesteps"]), learn_sigma, sigma_small=bool(diffusion.get("sigma_small", False))
    )


def sample_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``cfg.sample`` with ``clip_denoised`` resolved: ``null`` = clip the predicted x_0 to [-1, 1]
    in pixel space (ADM's choice for images), not in latent space (DiT's: latents are unbounded)."""
    sample = dict(cfg["sample"])
    if sample.get("clip_denoised") is None:
        sample["clip_denoised"] = not uses_vae(cfg)
    return sample


MODES = ("train", "sample", "eval", "cache_latents")
# mode=sample / eval with ckpt=RUN_DIR take these groups from the training run (visattn.engine.training_run):
# the model, its diffusion and data, and how the run sampled and scored
RUN_GROUPS = ("dit", "attn", "budget", "diffusion", "vae", "data", "sample", "eval")


def min_eval_samples() -> int:
    """The fewest samples every score needs: FID a covariance (>= 2), precision / recall more points
    than the scorer's k nearest neighbours (k + 1; ADM's k = 3)."""
    k = inspect.signature(GenerationScorer).parameters["k"].default
    return max(2, k + 1)


def _check_training(cfg: dict[str, Any], world_size: int) -> None:
    train = cfg["train"]
    if train.get("grad_clip") is not None:  # the old spelling
        log.warning("train.grad_clip is deprecated; write train.clip_grad=%s (both tasks use that key)",
                    train["grad_clip"])
        if train.get("clip_grad") is not None and train["clip_grad"] != train["grad_clip"]:
            raise ValueError(f"train.grad_clip={train['grad_clip']} and train.clip_grad={train['clip_grad']} "
                             "disagree; set only train.clip_grad")
        train["clip_grad"] = train["grad_clip"]
    require_count("train.steps", train["steps"])
    require_count("train.batch_size", train["batch_size"], why=" (the global batch)")
    require(train["batch_size"] % world_size == 0, "train.batch_size", train["batch_size"],
            f"is not divisible by the {world_size} processes; use a multiple of {world_size}")
    require_positive("train.lr", train["lr"])
    require_positive("train.weight_decay", train["weight_decay"], allow_zero=True)
    require_positive("train.aux_loss_weight", train["aux_loss_weight"], allow_zero=True)
    require(isinstance(train["ema_decay"], (int, float)) and 0.0 <= train["ema_decay"] <= 1.0, "train.ema_decay",
            train["ema_decay"], "must be in [0, 1] (DiT: 0.9999)")
    if train.get("clip_grad") is not None:
        require_positive("train.clip_grad", train["clip_grad"])
    require_count("train.max_nonfinite_steps", train["max_nonfinite_steps"], minimum=0)
    require_count("train.log_every", train["log_every"])
    require_count("train.ckpt_every", train["ckpt_every"])
    train["amp"] = normalize_amp(train["amp"])
    require(isinstance(train.get("tf32", True), bool), "train.tf32", train.get("tf32"), "must be true or false")
    check_compile_setting(train.get("compile", False))
    check_attn_paths(train.get("attn_paths", "dense"))
    sched = cfg["sched"]
    require(sched["name"] in SCHEDULES, "sched.name", sched["name"], f"is not known; use one of {'|'.join(SCHEDULES)}")
    for key in ("warmup_epochs", "warmup_lr", "min_lr"):
        require_positive(f"sched.{key}", sched[key], allow_zero=True)
    if uses_vae(cfg) and not cfg["data"].get("latents"):
        raise ValueError(
            "vae=sd trains on a latent cache: set data.latents=DIR (create it with "
            "`python train_dit.py mode=cache_latents vae=sd data=... data.latents=DIR`)"
        )


def _check_sampling(cfg: dict[str, Any], in_channels: int, scoring: bool) -> None:
    sample, mode = cfg["sample"], cfg["mode"]
    require_count("sample.batch_size", sample["batch_size"], why=" (per process)")
    if mode == "sample":
        require_count("sample.num_samples", sample["num_samples"])
    require_count("sample.grid", sample["grid"], minimum=0)
    sample["amp"] = normalize_amp(sample.get("amp", "auto"), "sample.amp")
    check_compile_setting(sample.get("compile", False), "sample.compile")
    require(sample["sampler"] in SAMPLERS, "sample.sampler", sample["sampler"], f"is not known; use one of {SAMPLERS}")
    require_positive("sample.eta", sample["eta"], allow_zero=True)
    try:
        space_timesteps(int(cfg["diffusion"]["timesteps"]), sample["steps"])
    except ValueError as err:
        raise ValueError(f"sample.steps={sample['steps']!r}: {err}") from None
    require_positive("sample.cfg_scale", sample["cfg_scale"], allow_zero=True)
    if sample["cfg_scale"] != 1.0:
        require(float(cfg["dit"]["class_dropout_prob"]) > 0, "sample.cfg_scale", sample["cfg_scale"],
                "needs the null class, which a model trained with dit.class_dropout_prob=0 lacks; use cfg_scale=1")
    guided = sample.get("guided_channels")
    if guided is not None:
        require(isinstance(guided, int) and guided >= 1, "sample.guided_channels", guided,
                "must be null (every channel) or an integer >= 1 (DiT's sampler: 3)")
        if sample["cfg_scale"] != 1.0:
            require(guided <= in_channels, "sample.guided_channels", guided,
                    f"exceeds the model's {in_channels} channels; set sample.guided_channels=null to guide them all")
    if scoring:
        need = min_eval_samples()
        require_count("eval.num_samples", cfg["eval"]["num_samples"], minimum=need,
                      why=f" (FID needs 2, precision/recall more than k={need - 1} neighbours)")
        require_count("eval.head_load_images", cfg["eval"]["head_load_images"], minimum=0)


def validate_dit_config(cfg: Mapping[str, Any], world_size: int = 1) -> dict[str, Any]:
    """Check every value of the resolved config before any work (nothing is loaded or trained);
    returns the config with deprecated spellings mapped to the current keys. Raises ValueError /
    FileNotFoundError naming the key, the value and the fix. Guidance: ``sample.cfg_scale`` >= 0
    (0 = unconditional, 1 = the conditional model with no guidance, as in DiT; > 1 guided)."""
    cfg = copy.deepcopy(dict(cfg))
    mode = cfg["mode"]
    require(mode in MODES, "mode", mode, f"is not known; use one of {MODES}")
    require(cfg["device"] in ("auto", "cpu", "cuda"), "device", cfg["device"], "is not known; use auto, cpu or cuda")
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but CUDA is not available here; use device=cpu (or auto)")
    resume = cfg.get("resume")
    require(resume in (True, False, "auto", None), "resume", resume, "must be auto, true or false")
    require_positive("seed", cfg["seed"], allow_zero=True)
    geometry = model_geometry(cfg)  # also checks vae.name and the VAE's downsampling
    if mode in ("sample", "eval"):
        ckpt = cfg.get("ckpt")
        if not ckpt:
            raise ValueError(f"mode={mode} needs ckpt=PATH (a run dir, a checkpoint folder RUN_DIR/checkpoints/step-N, "
                             "an ema.safetensors or an original DiT .pt)")
        if not Path(ckpt).exists():
            raise FileNotFoundError(f"ckpt={ckpt} does not exist; give a run dir, a checkpoint folder or a weight file")
    if mode == "train":
        _check_training(cfg, world_size)
    if not uses_vae(cfg) and mode != "cache_latents" and not is_array_dataset(cfg["data"]["name"]):
        raise ValueError(f"data={cfg['data']['name']} has no in-memory pixel loader for DiT; use one of "
                         f"{array_dataset_names()} in pixel space, or vae=sd with a latent cache (mode=cache_latents)")
    scoring = mode == "eval" or (mode == "train" and bool(cfg["eval"]["enabled"]))
    if mode != "cache_latents":
        _check_sampling(cfg, geometry["in_channels"], scoring)
        try:
            with torch.device("meta"):
                build_model(cfg)
        except (ValueError, TypeError, KeyError) as err:
            raise ValueError(f"{err} [dit.preset={cfg['dit']['preset']}, attn={(cfg.get('attn') or {}).get('name')}]"
                             ) from None
    return cfg
