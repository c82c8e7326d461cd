"""Classification set-up from the Hydra config: the attention spec (attn + budget), the model, the
config validation that runs before any work, and loading outside weights into the model."""

from __future__ import annotations

import fnmatch
import logging
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

import visattn.models  # noqa: F401  (registers the visattn_* timm models)
from visattn.attention import active_heads, attention_modules, convert_moh_state_dict
from visattn.data.datasets import check_data_config
from visattn.engine.amp import normalize_amp
from visattn.engine.checkpoints import MANIFEST, MODEL_WEIGHTS, verify_checkpoint
from visattn.engine.moh_paths import check_attn_paths
from visattn.engine.step import check_compile_setting
from visattn.models.budgets import apply_budget
from visattn.models.transnext import TransNeXt
from visattn.models.transnext import checkpoint_filter_fn as transnext_checkpoint_filter_fn
from visattn.utils.checkpoint import load_weights
from visattn.utils.checks import require_count, require_positive

log = logging.getLogger(__name__)

MODES = ("train", "eval")
# mode=eval ckpt=RUN_DIR takes these groups from the training run (visattn.engine.training_run)
RUN_GROUPS = ("model", "attn", "budget", "data", "aug")
BEST_WEIGHTS = "best.safetensors"


def plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def budget_name(cfg: DictConfig) -> str:
    return cfg.budget.get("name", "none") if cfg.get("budget") else "none"


def attn_spec(cfg: DictConfig) -> dict[str, Any]:
    """``cfg.attn`` with the head budget applied: ``{"name": ..., **kwargs}``."""
    return model_kwargs(cfg)["attn"]


def model_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """Keywords for ``timm.create_model(cfg.model.name, **kwargs)``, the head budget applied
    (``visattn.models.budgets``: the one home of budgets, shared with DiT). A budget may only set
    routing keys that the chosen attention's config declares (conf/attn/<name>.yaml)."""
    kwargs = dict(
        attn=plain(cfg.attn),
        num_classes=cfg.data.num_classes,
        in_chans=cfg.data.in_chans,
        img_size=cfg.data.image_size,
        drop_path_rate=cfg.model.drop_path_rate,
        **plain(cfg.model.get("kwargs") or {}),
    )
    return apply_budget(kwargs, plain(cfg.get("budget")), declared_only=True)


def build_cls_model(cfg: DictConfig) -> nn.Module:
    """The configured classifier (on the current default device); images [B, C, H, W] -> [B, classes]."""
    return timm.create_model(cfg.model.name, **model_kwargs(cfg))


def _check_path(key: str, value: Any, what: str) -> None:
    if value is not None and not Path(value).exists():
        raise FileNotFoundError(f"{key}={value} does not exist; {what}")


def validate_cls_config(cfg: DictConfig, world_size: int = 1) -> nn.Module:
    """Check the composed config before any work; returns the model built on the meta device.

    Raises ValueError / FileNotFoundError naming the key, the bad value and the fix.
    """
    if cfg.mode not in MODES:
        raise ValueError(f"mode={cfg.mode} is not known; use one of {MODES}")
    if cfg.mode == "eval" and cfg.ckpt is None:
        raise ValueError("mode=eval needs ckpt=PATH (a weight file, or a run dir holding best.safetensors)")
    _check_path("ckpt", cfg.ckpt, "give a weight file (.safetensors/.pth) or a run dir")
    _check_path("model.init_from", cfg.model.init_from, "give a weight file (.safetensors/.pth) of a trained model")
    if not isinstance(cfg.resume, bool) and cfg.resume != "auto":
        _check_path("resume", cfg.resume, "give auto, true (this run dir), false or the run dir to continue")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={cfg.device} is not known; use auto, cpu or cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but CUDA is not available here; use device=cpu (or auto)")
    check_data_config(cfg.data)
    train = cfg.train
    require_count("train.epochs", train.epochs)
    require_count("train.batch_size", train.batch_size, why=" (the global batch)")
    require_count("train.eval_batch_size", train.eval_batch_size, why=" (per process)")
    require_count("train.eval_every", train.eval_every)
    require_count("train.max_nonfinite_steps", train.max_nonfinite_steps, minimum=0)
    require_count("train.log_every", train.get("log_every", 50))
    if not isinstance(train.get("tf32", True), bool):
        raise ValueError(f"train.tf32={train.tf32!r} must be true or false")
    check_compile_setting(train.get("compile", False))
    check_attn_paths(train.get("attn_paths", "dense"))
    if train.stop_after_epoch is not None:
        require_count("train.stop_after_epoch", train.stop_after_epoch)
    require_positive("optim.lr", cfg.optim.lr)
    require_positive("optim.weight_decay", cfg.optim.weight_decay, allow_zero=True)
    require_positive("train.aux_loss_weight", train.aux_loss_weight, allow_zero=True, fix=" (MoH: 0.01)")
    if train.ema and not (isinstance(train.ema_decay, (int, float)) and 0.0 <= train.ema_decay <= 1.0):
        raise ValueError(f"train.ema_decay={train.ema_decay!r} must be in [0, 1] (e.g. 0.99996)")
    if train.clip_grad is not None:
        require_positive("train.clip_grad", train.clip_grad, fix="; null turns clipping off")
    normalize_amp(train.amp)
    for key in ("warmup_lr", "min_lr"):
        require_positive(f"sched.{key}", cfg.sched[key], allow_zero=True)
    if cfg.sched.warmup_epochs >= train.epochs and cfg.sched.warmup_epochs > 0:
        raise ValueError(
            f"sched.warmup_epochs={cfg.sched.warmup_epochs} leaves no epoch after warm-up "
            f"(train.epochs={train.epochs}); lower it below train.epochs"
        )
    if train.batch_size % world_size:
        raise ValueError(
            f"train.batch_size={train.batch_size} is not divisible by the {world_size} processes; use a multiple"
        )
    if (cfg.aug.mixup > 0 or cfg.aug.cutmix > 0) and (train.batch_size // world_size) % 2:
        raise ValueError(
            f"train.batch_size={train.batch_size} gives an odd batch per process; Mixup/CutMix needs an even one"
        )
    if not 0.0 <= cfg.aug.label_smoothing < 1.0:
        raise ValueError(f"aug.label_smoothing={cfg.aug.label_smoothing} must be in [0, 1)")
    where = f"[model={cfg.model.name}, attn={cfg.attn.name}, budget={budget_name(cfg)}]"
    try:
        with torch.device("meta"):
            model = build_cls_model(cfg)
    except (ValueError, TypeError) as err:
        budget = budget_name(cfg)
        given = [f"budget.{key}" for key in ("num_heads", "shared_heads", "routed_topk")
                 if cfg.get("budget") and cfg.budget.get(key) is not None]
        if budget != "none":
            hint = (f" (budget={budget} supplies the per-layer lists: pick a budget written for this model's depth, "
                    f"or budget=none)")
        else:
            hint = f" (from {', '.join(given)}: one value per layer, or a single value)" if given else ""
        raise ValueError(f"{err}{hint} {where}") from None
    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if patch is not None and cfg.data.image_size % patch[0]:
        raise ValueError(
            f"data.image_size={cfg.data.image_size} is not a multiple of the model's patch size {patch[0]} "
            f"{where}; pick a model whose patch size divides it"
        )
    return model


def log_head_budget(model: nn.Module) -> None:
    """Heads active per token, per layer and in all (the activation ratio)."""
    layers = [m.active_heads if hasattr(m, "active_heads") else (m.num_heads, m.num_heads)
              for _, m in attention_modules(model)]
    active, total = active_heads(model)
    log.info("heads active per layer: %s", " ".join(f"{a}/{t}" for a, t in layers))
    log.info("activation ratio: %d/%d = %.1f%%", active, total, 100.0 * active / max(total, 1))


def resolve_weight_path(path: str | Path) -> Path:
    """A weight file, a checkpoint folder (its model.safetensors) or a run dir (its best.safetensors)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return verify_checkpoint(path).path / MODEL_WEIGHTS
    if path.is_dir():
        path = path / BEST_WEIGHTS
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist; give a weight file or a run dir that finished an epoch")
    return path


def load_model_weights(model: nn.Module, path: str | Path, new_head_ok: bool = False) -> None:
    """Load ours / timm / DeiT weights into ``model``.

    Parameters of attention layers that the file lacks (e.g. MoH routers, when the file is an MHA
    model) keep their initialisation; anything else missing, unexpected or of another shape is an
    error, except the classifier head when ``new_head_ok`` (fine-tuning to other classes).
    """
    path = resolve_weight_path(path)
    state = convert_moh_state_dict(load_weights(path))
    if hasattr(model, "patch_embed") and hasattr(model, "blocks"):  # timm ViT layouts, pos-embed resizing
        from timm.models.vision_transformer import checkpoint_filter_fn

        state = checkpoint_filter_fn(state, model)
    elif isinstance(model, TransNeXt):  # released TransNeXt / MoH-ViT keys, and our old stage layout
        state = transnext_checkpoint_filter_fn(state, model)
    own = model.state_dict()
    attn_prefixes = tuple(f"{name}." for name, _ in attention_modules(model))
    head_names = [n for n in own if fnmatch.fnmatch(n, "head.*")]
    mismatched = {k: (tuple(v.shape), tuple(own[k].shape)) for k, v in state.items() if k in own and v.shape != own[k].shape}
    if new_head_ok:
        for name in head_names:
            if name in mismatched:
                log.warning("%s: %s has shape %s, the model %s; the head is re-initialised", path, name, *mismatched[name])
                del mismatched[name], state[name]
    missing = [k for k in own if k not in state]
    new_attn = [k for k in missing if k.startswith(attn_prefixes)]
    missing = [k for k in missing if k not in new_attn and not (new_head_ok and k in head_names)]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected or mismatched:
        raise ValueError(
            f"{path} does not fit {type(model).__name__}: missing {missing[:6]}, unexpected {unexpected[:6]}, "
            f"shape (file, model) {dict(list(mismatched.items())[:6])}; check model= (and model.kwargs), attn=, "
            f"budget= and data.num_classes against the model that wrote the file (ckpt=RUN_DIR of a training "
            f"run takes them from the run)"
        )
    model.load_state_dict(state, strict=False)
    log.info("loaded %s (%d tensors)%s", path, len(state),
             f"; {len(new_attn)} attention parameters kept at init" if new_attn else "")

