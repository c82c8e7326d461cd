"""Classification training and evaluation (``train_cls.py``): one process or DDP under torchrun.

Run dir outputs: ``metrics.csv`` + ``tb/`` (per epoch), ``last.safetensors`` + ``last_state.pt``
and ``best.safetensors`` (atomic, every epoch), ``results.json``, and ``head_load.json`` for
routed models. ``loss = task + beta * visattn.aux_loss(model)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from timm.loss import SoftTargetCrossEntropy
from tqdm import tqdm

from visattn.attention import active_heads, aux_loss
from visattn.data.datasets import build_datasets
from visattn.data.loaders import build_loaders, build_mixup
from visattn.data.sources import class_names
from visattn.utils.checkpoint import (
    load_train_state,
    load_weights,
    rng_state,
    save_train_state,
    save_weights,
    set_rng_state,
    weights_metadata,
)

from .cls_eval import HeadLoadMeter, evaluate
from .cls_setup import (
    BEST_WEIGHTS,
    attn_spec,
    budget_name,
    build_cls_model,
    load_model_weights,
    log_head_budget,
    validate_cls_config,
)
from .distributed import (
    DistInfo,
    all_gather_object,
    all_reduce_sum,
    barrier,
    cleanup_distributed,
    init_distributed,
)
from .ema import ModelEMA, unwrap_model
from .launch import agreed_run_dir, seed_everything
from .optim import WarmupSchedule, build_optimizer
from .results import Throughput, count_params, model_flops, peak_memory_mb, write_json, write_results
from .runlog import MetricsLogger, setup_logging

log = logging.getLogger(__name__)

LAST_WEIGHTS = "last.safetensors"
LAST_STATE = "last_state.pt"
HEAD_LOAD_FILE = "head_load.json"


def amp_dtype(setting: Any, device: torch.device) -> torch.dtype | None:
    """bf16 autocast: ``auto`` = on for CUDA devices that support bf16, off on CPU."""
    if setting == "auto":
        on = device.type == "cuda" and torch.cuda.is_bf16_supported()
    else:
        on = bool(setting)
    return torch.bfloat16 if on else None


def task_criterion(mixup_on: bool, label_smoothing: float) -> nn.Module:
    if mixup_on:  # Mixup folds label smoothing into its soft targets
        return SoftTargetCrossEntropy()
    return nn.CrossEntropyLoss(label_smoothing=label_smoothing)


def _class_names(dataset) -> list[str] | None:
    classes = getattr(dataset, "classes", None)
    return list(classes) if classes is not None else None


class ClsRun:
    """One classification run: everything built from the config, then ``train()`` or ``eval()``."""

    def __init__(self, cfg: DictConfig, run_dir: str | Path, dist_info: DistInfo) -> None:
        self.cfg = cfg
        self.dist = dist_info
        self.device = dist_info.device
        self.run_dir = Path(run_dir)
        self.amp_dtype = amp_dtype(cfg.train.amp, self.device)
        self.t0 = time.perf_counter()

        seed_everything(cfg.seed)  # same initial weights on every rank
        self.model = build_cls_model(cfg)
        log_head_budget(self.model)
        if cfg.model.init_from is not None and cfg.mode == "train":
            load_model_weights(self.model, cfg.model.init_from, new_head_ok=True)
        self.model.to(self.device)
        active, total = active_heads(self.model)
        self.routed = active < total
        seed_everything(cfg.seed + dist_info.rank)  # augmentation differs per rank

        self.train_set, self.val_set = build_datasets(cfg.data, cfg.aug, seed=cfg.seed)
        self.train_loader, self.val_loader = build_loaders(
            self.train_set, self.val_set, cfg.train.batch_size, dist_info.rank, dist_info.world_size,
            seed=cfg.seed, num_workers=cfg.data.get("num_workers", 0), repeated_aug=cfg.aug.repeated_aug,
            eval_batch_size=cfg.train.eval_batch_size, pin_memory=self.device.type == "cuda",
        )
        self.classes = _class_names(self.val_set) or class_names(cfg.data.name, cfg.data.num_classes)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype else contextlib.nullcontext()

    # ---------------------------------------------------------------- evaluation
    def _evaluate(self, model: nn.Module, with_head_load: bool = False) -> tuple[dict[str, float], dict | None]:
        meter = HeadLoadMeter(model, self.cfg.data.num_classes, self.device) if with_head_load else None
        metrics = evaluate(model, self.val_loader, self.device, self.cfg.data.num_classes, self.amp_dtype, meter)
        return metrics, (meter.reduce(self.classes) if meter is not None else None)

    def eval(self) -> dict[str, Any]:
        load_model_weights(self.model, self.cfg.ckpt)
        metrics, load = self._evaluate(self.model, with_head_load=self.routed)
        results = {**self._summary(), **metrics, "top1_best": metrics["top1"], "ckpt": str(self.cfg.ckpt)}
        if self.dist.is_main:
            if load is not None:
                write_json(self.run_dir / HEAD_LOAD_FILE, load)
            write_results(self.run_dir, results)
        return results

    # ---------------------------------------------------------------- training
    def train(self) -> dict[str, Any]:
        cfg, dist = self.cfg, self.dist
        model = self.model
        ema = ModelEMA(model, cfg.train.ema_decay) if cfg.train.ema else None
        optimizer = build_optimizer(model, cfg.optim)
        steps_per_epoch = len(self.train_loader)
        schedule = WarmupSchedule(
            cfg.optim.lr, cfg.train.epochs * steps_per_epoch, round(cfg.sched.warmup_epochs * steps_per_epoch),
            cfg.sched.warmup_lr, cfg.sched.min_lr, cfg.sched.name,
        )
        if dist.distributed:
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        if cfg.train.compile:
            model = torch.compile(model)
        mixup = build_mixup(cfg.aug, cfg.data.num_classes)
        criterion = task_criterion(mixup is not None, cfg.aug.label_smoothing)
        logger = MetricsLogger(self.run_dir, tensorboard=cfg.train.tensorboard, enabled=dist.is_main)

        start_epoch, step, best = 0, 0, -1.0
        if cfg.resume:
            start_epoch, step, best = self._resume(optimizer, ema)
            logger.drop_after(step)
        train_images, train_seconds = 0, 0.0
        metrics: dict[str, float] = {}
        for epoch in range(start_epoch, cfg.train.epochs):
            self.train_loader.sampler.set_epoch(epoch)
            model.train()
            sums = torch.zeros(3, device=self.device, dtype=torch.float64)  # loss, aux, batches
            bar = tqdm(self.train_loader, desc=f"epoch {epoch + 1}/{cfg.train.epochs}", leave=False,
                       disable=not (cfg.train.progress and dist.is_main))
            timer = Throughput(self.device)
            timer.start()
            epoch_images = 0
            for images, labels in bar:
                images, labels = images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
                if mixup is not None:
                    images, labels = mixup(images, labels)
                lr = schedule.apply(optimizer, step)
                with self._autocast():
                    logits = model(images)
                    task = criterion(logits.float(), labels)
                aux = aux_loss(model)
                loss = task + cfg.train.aux_loss_weight * aux
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.train.clip_grad:
                    nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip_grad)
                optimizer.step()
                if ema is not None:
                    ema.update(model)
                step += 1
                epoch_images += len(images)
                sums += torch.stack([task.detach(), aux.detach(), torch.ones((), device=self.device)]).to(sums.dtype)
                if step % 10 == 0 and not bar.disable:
                    bar.set_postfix(loss=f"{task.item():.3f}", lr=f"{lr:.2e}")
            timer.stop(epoch_images)
            train_images, train_seconds = train_images + epoch_images, train_seconds + timer.seconds
            all_reduce_sum(sums)
            epoch_rate = all_reduce_sum(torch.tensor([timer.rate], device=self.device, dtype=torch.float64))
            last = epoch + 1 == cfg.train.epochs
            stop = cfg.train.stop_after_epoch is not None and epoch + 1 >= cfg.train.stop_after_epoch
            row: dict[str, Any] = {
                "step": step, "epoch": epoch + 1, "loss": sums[0].item() / sums[2].item(),
                "aux_loss": sums[1].item() / sums[2].item(), "lr": optimizer.param_groups[0]["lr"],
                "images_per_s": epoch_rate.item(),
            }
            if last or stop or (epoch + 1) % cfg.train.eval_every == 0:
                metrics, load = self._evaluate(unwrap_model(model), with_head_load=self.routed)
                row.update(metrics)
                best = max(best, metrics["top1"])
                if load is not None:
                    row.update({f"head_load/layer{i}": np.mean(layer, axis=0).tolist()
                                for i, layer in enumerate(load["load"])})
                    if dist.is_main:
                        write_json(self.run_dir / HEAD_LOAD_FILE, load)
                if ema is not None:
                    row["top1_ema"] = evaluate(ema.module, self.val_loader, self.device, cfg.data.num_classes,
                                               self.amp_dtype)["top1"]
                if metrics["top1"] >= best and dist.is_main:
                    save_weights(self.run_dir / BEST_WEIGHTS, unwrap_model(model).state_dict(),
                                 {"epoch": str(epoch + 1), "top1": str(metrics["top1"])})
                log.info("epoch %d/%d: loss %.4f top1 %.4f top5 %.4f (best %.4f)", epoch + 1, cfg.train.epochs,
                         row["loss"], metrics["top1"], metrics["top5"], best)
            logger.log(row)
            self._save_last(model, optimizer, ema, epoch + 1, step, best)
            if stop and not last:
                log.info("stopping after epoch %d (train.stop_after_epoch); continue with resume=true", epoch + 1)
                break
        logger.close()
        results = {
            **self._summary(), **metrics, "top1_best": best, "epochs": cfg.train.epochs,
            "train_images_per_s": train_images / max(train_seconds, 1e-9) * dist.world_size, "train_steps": step,
            "completed": not (cfg.train.stop_after_epoch and cfg.train.stop_after_epoch < cfg.train.epochs),
        }
        if dist.is_main:
            write_results(self.run_dir, results)
        return results

    def _save_last(self, model, optimizer, ema, epoch: int, step: int, best: float) -> None:
        rngs = all_gather_object(rng_state())  # every rank's generators
        if not self.dist.is_main:
            return
        meta = {"epoch": str(epoch), "step": str(step)}
        save_weights(self.run_dir / LAST_WEIGHTS, unwrap_model(model).state_dict(), meta)
        state = {
            "epoch": epoch, "step": step, "best_top1": best, "world_size": self.dist.world_size,
            "optimizer": optimizer.state_dict(), "rng": rngs,
            "ema": ema.state_dict() if ema is not None else None,
        }
        save_train_state(self.run_dir / LAST_STATE, state)

    def _resume(self, optimizer, ema) -> tuple[int, int, float]:
        weights, state_path = self.run_dir / LAST_WEIGHTS, self.run_dir / LAST_STATE
        if not (weights.is_file() and state_path.is_file()):
            raise FileNotFoundError(
                f"resume={self.cfg.resume}: {weights} or {state_path} is missing; resume in the run dir of a run "
                "that finished an epoch (resume=RUN_DIR or hydra.run.dir=RUN_DIR resume=true)"
            )
        state = load_train_state(state_path)
        if weights_metadata(weights).get("step") != str(state["step"]):
            raise ValueError(f"{weights} and {state_path} are from different steps; the run was killed while saving")
        self.model.load_state_dict(load_weights(weights))
        optimizer.load_state_dict(state["optimizer"])
        if ema is not None and state["ema"] is not None:
            ema.load_state_dict(state["ema"])
        if state["world_size"] == self.dist.world_size:
            set_rng_state(state["rng"][self.dist.rank])
        else:
            log.warning("resuming with %d processes, saved with %d: data order and augmentation differ",
                        self.dist.world_size, state["world_size"])
        log.info("resumed from %s at epoch %d (step %d)", self.run_dir, state["epoch"], state["step"])
        return state["epoch"], state["step"], state["best_top1"]

    def _summary(self) -> dict[str, Any]:
        model = self.model
        active, total = active_heads(model)
        sample = torch.zeros(1, self.cfg.data.in_chans, self.cfg.data.image_size, self.cfg.data.image_size,
                             device=self.device)
        return {
            "task": "cls", "attn": self.cfg.attn.name, "attn_spec": attn_spec(self.cfg),
            "model": self.cfg.model.name, "budget": budget_name(self.cfg), "data": self.cfg.data.name,
            "seed": self.cfg.seed, "world_size": self.dist.world_size,
            "active_heads": [active, total], "active_ratio": active / max(total, 1),
            "params": count_params(model), "flops_per_image": model_flops(model, sample),
            "peak_memory_mb": peak_memory_mb(self.device), "wall_time_s": time.perf_counter() - self.t0,
            "run_dir": str(self.run_dir), "config": OmegaConf.to_container(self.cfg, resolve=True),
        }


def run_cls(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Validate ``cfg``, then train or evaluate; returns what ``results.json`` holds."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_cls_config(cfg, world_size)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    dist_info = init_distributed(None if cfg.device == "auto" else cfg.device)
    try:
        setup_logging(dist_info.rank)
        run_dir = agreed_run_dir(cfg.resume if isinstance(cfg.resume, str) else run_dir)
        run = ClsRun(cfg, run_dir, dist_info)
        results = run.eval() if cfg.mode == "eval" else run.train()
        barrier()
        return results
    finally:
        cleanup_distributed()
