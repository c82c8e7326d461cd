"""Classification training and evaluation (``train_cls.py``): one process or DDP under torchrun.

Run dir outputs: ``metrics.csv`` + ``tb/`` (per epoch), ``checkpoints/step-N/`` (one atomic unit,
see ``checkpoints``; every epoch, before evaluating, and on preemption mid-epoch),
``best.safetensors`` (atomic), ``results.json``, and ``head_load.json`` for routed models.
``loss = task + beta * visattn.aux_loss(model)``.

An epoch that is evaluated is saved first, its evaluation marked pending (its metrics row, without
the metrics, in the state); the evaluation then logs the row, updates best.safetensors and adds its
metrics to the checkpoint (``record_evaluation``). A run stopped during the evaluation resumes by
running it; a resume of a finished run takes the final metrics from the record.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from timm.loss import SoftTargetCrossEntropy
from tqdm import tqdm

from visattn.attention import active_heads, aux_loss, impl_choices
from visattn.attention.train_paths import empty_record
from visattn.data.datasets import build_datasets
from visattn.data.images import skipped_files
from visattn.data.loaders import build_loaders, build_mixup
from visattn.data.registry import class_names
from visattn.engine.amp import StepProbe, apply_tf32, choose_amp
from visattn.engine.checkpoints import (
    EMA_WEIGHTS,
    MODEL_WEIGHTS,
    Checkpoint,
    checkpoint_to_resume,
    record_evaluation,
    save_checkpoint,
)
from visattn.engine.cls.evaluation import evaluate
from visattn.engine.cls.setup import (
    BEST_WEIGHTS,
    attn_spec,
    budget_name,
    build_cls_model,
    load_model_weights,
    log_head_budget,
    validate_cls_config,
)
from visattn.engine.data_skip import skip_first_batches
from visattn.engine.distributed import all_gather_object, all_reduce_sum, barrier, broadcast_module
from visattn.engine.ema import ModelEMA, unwrap_model
from visattn.engine.guard import GRADIENTS, NonFiniteError, NonFiniteGuard, cause_hint, require_finite
from visattn.engine.head_load import HEAD_LOAD_FILE, HeadLoadMeter
from visattn.engine.launch import Launched, launched, seed_everything
from visattn.engine.moh_paths import RECORD_KEY, saved_train_paths, settle_train_paths
from visattn.engine.optim import WarmupSchedule, build_optimizer
from visattn.engine.preempt import Preempted
from visattn.engine.results import (
    RunClock,
    Throughput,
    count_params,
    model_flops,
    peak_memory_mb,
    write_json,
    write_results,
)
from visattn.engine.run_identity import run_definition
from visattn.engine.runlog import MetricsLogger
from visattn.engine.step import StepGate, clip_and_norm, compiled, optimizer_step
from visattn.engine.training_run import refuse_to_overwrite_training
from visattn.utils.checkpoint import rng_state, save_weights, set_rng_state
from visattn.utils.flops import active_head_flops

log = logging.getLogger(__name__)



def task_criterion(mixup_on: bool, label_smoothing: float) -> nn.Module:
    if mixup_on:  # Mixup folds label smoothing into its soft targets
        return SoftTargetCrossEntropy()
    return nn.CrossEntropyLoss(label_smoothing=label_smoothing)


def _class_names(dataset) -> list[str] | None:
    classes = getattr(dataset, "classes", None)
    return list(classes) if classes is not None else None


@dataclass
class _Position:
    """Where training is: epochs done, batches done in the next epoch, optimizer steps, best top-1,
    and that epoch's running sums (loss, aux, batches)."""

    epoch: int = 0
    batches: int = 0
    step: int = 0
    best: float = -1.0
    sums: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))


class ClsRun:
    """One classification run: everything built from the config, then ``train()`` or ``eval()``."""

    def __init__(self, cfg: DictConfig, ctx: Launched) -> None:
        self.cfg = cfg
        self.dist = dist_info = ctx.dist
        self.device = dist_info.device
        self.run_dir = ctx.run_dir
        self.stop = ctx.stop
        self.resume_notes = ctx.resume_notes  # an accepted config change on resume (run_identity)
        self.definition = run_definition(OmegaConf.to_container(cfg, resolve=True))  # in every checkpoint
        self.clock = RunClock()  # every process of this run, across resumes (in the checkpoints)
        self.trained = Throughput(self.device)  # every epoch of this run, across resumes (in the checkpoints)
        self.tf32 = apply_tf32(cfg.train.get("tf32", True), self.device)

        seed_everything(cfg.seed)  # same initial weights on every rank
        self.model = build_cls_model(cfg)
        log_head_budget(self.model)
        if cfg.model.init_from is not None and cfg.mode == "train":
            load_model_weights(self.model, cfg.model.init_from, new_head_ok=True)
        self.model.to(self.device)
        broadcast_module(self.model)  # rank 0's weights everywhere, before any EMA copies them
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
        # read now: a resumed run keeps the mixed precision its checkpoint records
        found = checkpoint_to_resume(cfg.resume, self.run_dir) if cfg.mode == "train" else None
        self._resume_from = (found, found.state()) if found is not None else None
        saved = self._resume_from[1].get("amp") if self._resume_from is not None else None
        self.amp = choose_amp(cfg.train.amp, self.device, self._step_probe(), saved=saved)
        self.amp_dtype = self.amp.dtype
        self.train_paths = empty_record("evaluation") if cfg.mode != "train" else settle_train_paths(
            self.model, cfg.train.get("attn_paths", "dense"), self._step_probe().loss, self._autocast,
            saved_train_paths(self._resume_from[1] if self._resume_from is not None else None),
            compile=bool(cfg.train.compile),
        )

    def _step_probe(self) -> StepProbe:
        """A training step (evaluation: a forward pass) of this model on random images of the run's
        per-process batch shape, for ``train.amp=auto`` to time. The batch is drawn when the probe
        runs (only ``auto`` on CPU does), from its own generator: the run's random streams are left
        as they are."""
        cfg, training = self.cfg, self.cfg.mode == "train"
        batch = self.train_loader.batch_size if training else self.val_loader.batch_size
        size = cfg.data.image_size

        def loss() -> torch.Tensor:
            gen = torch.Generator().manual_seed(0)
            images = torch.randn(batch, cfg.data.in_chans, size, size, generator=gen).to(self.device)
            labels = torch.randint(0, cfg.data.num_classes, (batch,), generator=gen).to(self.device)
            return nn.functional.cross_entropy(self.model(images), labels)

        return StepProbe(self.model, loss, backward=training)

    def _autocast(self):
        return self.amp.autocast(self.device)

    # ---------------------------------------------------------------- evaluation
    def _evaluate(self, model: nn.Module, with_head_load: bool = False, step: int = 0) -> tuple[dict[str, float], dict | None]:
        """Top-1 etc. of ``model`` (the weights of the checkpoint of ``step``); a stop signal ends it with
        ``Preempted`` after the current batch."""
        meter = HeadLoadMeter(model, self.cfg.data.num_classes, self.device) if with_head_load else None
        metrics = evaluate(model, self.val_loader, self.device, self.cfg.data.num_classes, self.amp_dtype, meter,
                           stop=self.stop, step=step)
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
        """Train (resuming per ``cfg.resume``); results.json records a finished run, a preempted one
        (``completed: false, preempted: true``) or a failed one (``completed: false, failure``)."""
        try:
            return self._train()
        except NonFiniteError as err:
            if self.dist.is_main:
                write_results(self.run_dir, {**self._summary(), "completed": False, "failure": err.failure})
            raise

    def _train(self) -> dict[str, Any]:
        cfg, dist = self.cfg, self.dist
        model = self.model
        ema = ModelEMA(model, cfg.train.ema_decay) if cfg.train.ema else None
        optimizer = build_optimizer(model, cfg.optim, self.device)
        steps_per_epoch = len(self.train_loader)
        schedule = WarmupSchedule(
            cfg.optim.lr, cfg.train.epochs * steps_per_epoch, round(cfg.sched.warmup_epochs * steps_per_epoch),
            cfg.sched.warmup_lr, cfg.sched.min_lr, cfg.sched.name,
        )
        guard = NonFiniteGuard(cfg.train.max_nonfinite_steps,
                               cause_hint(cfg.optim.lr, cfg.train.amp, cfg.data.name))
        gate = StepGate(guard, self.stop, self.device, grad_what="gradient norm" if cfg.train.clip_grad else GRADIENTS)
        if dist.distributed:
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        model = compiled(model, cfg.train.compile)
        mixup = build_mixup(cfg.aug, cfg.data.num_classes)
        criterion = task_criterion(mixup is not None, cfg.aug.label_smoothing)
        train_step = ClsStep(model, optimizer, ema, gate, schedule, criterion, self._autocast,
                             cfg.train.aux_loss_weight, cfg.train.clip_grad, mixup)
        log_every = cfg.train.get("log_every", 50)
        logger = MetricsLogger(self.run_dir, tensorboard=cfg.train.tensorboard, enabled=dist.is_main)

        pos = _Position()
        metrics: dict[str, float] = {}  # the last evaluation's
        if self._resume_from is not None:
            found, state = self._resume_from
            self._resume_from = None  # the optimizer state is not kept twice
            pos, pending_row = self._resume(found, state, optimizer, ema, guard)
            metrics = self._settle_saved_evaluation(found, pending_row, model, ema, pos, logger)
        for epoch in range(pos.epoch, cfg.train.epochs):
            self.train_loader.sampler.set_epoch(epoch)
            model.train()
            sums = pos.sums.to(self.device)  # loss, aux, batches (a resumed epoch continues its sums)
            bar = tqdm(self.train_loader, desc=f"epoch {epoch + 1}/{cfg.train.epochs}", leave=False,
                       disable=not (cfg.train.progress and dist.is_main), initial=pos.batches)
            timer = Throughput(self.device)
            timer.start()
            epoch_images, batches, stop = 0, pos.batches, False
            with skip_first_batches(self.train_loader, pos.batches):
                for images, labels in bar:
                    images = images.to(self.device, non_blocking=True)
                    labels = labels.to(self.device, non_blocking=True)
                    task, lr = train_step(pos.step, images, labels, sums)
                    pos.step += 1
                    batches += 1
                    epoch_images += len(images)
                    stop = gate.stop_now()
                    if pos.step % log_every == 0 or (stop and batches < steps_per_epoch):
                        # the host's read of the guard (NonFiniteError here, before any save, past the limit)
                        (shown,) = gate.sync(pos.step, task)
                        if not bar.disable:
                            bar.set_postfix(loss=f"{shown:.3f}", lr=f"{lr:.2e}")
                    if stop and batches < steps_per_epoch:  # at the epoch's end, the end-of-epoch save serves
                        timer.stop(epoch_images)
                        self.trained.add(epoch_images, timer.seconds)
                        # every rank's sums, so that the resumed epoch logs what an uninterrupted one would
                        pos = _Position(epoch, batches, pos.step, pos.best, self._rank0_total(sums))
                        self._save_last(model, optimizer, ema, guard, pos)
                        raise self._preempted(pos.step)
            gate.sync(pos.step)
            pos.batches, pos.sums = 0, torch.zeros(3, dtype=torch.float64)
            timer.stop(epoch_images)
            self.trained.add(epoch_images, timer.seconds)
            all_reduce_sum(sums)
            epoch_rate = all_reduce_sum(torch.tensor([timer.rate], device=self.device, dtype=torch.float64))
            last = epoch + 1 == cfg.train.epochs
            stop_here = cfg.train.stop_after_epoch is not None and epoch + 1 >= cfg.train.stop_after_epoch
            row: dict[str, Any] = {
                "step": pos.step, "epoch": epoch + 1, "loss": sums[0].item() / max(sums[2].item(), 1.0),
                "aux_loss": sums[1].item() / max(sums[2].item(), 1.0), "lr": optimizer.param_groups[0]["lr"],
                "images_per_s": epoch_rate.item(), "skipped_steps": guard.skipped,
            }
            evaluate_now = last or stop_here or (epoch + 1) % cfg.train.eval_every == 0
            if not evaluate_now:  # logged before the save: a resume from the previous checkpoint drops it
                logger.log(row)
            pos.epoch = epoch + 1
            self._save_last(model, optimizer, ema, guard, pos, pending_row=row if evaluate_now else None)
            if stop:  # the signal came during the epoch's last step; a resume evaluates the epoch
                raise self._preempted(pos.step)
            if evaluate_now:
                metrics = self._evaluate_saved_epoch(model, ema, row, pos, logger)
            if stop_here and not last:
                log.info("stopping after epoch %d (train.stop_after_epoch); continue with resume=true", epoch + 1)
                break
        logger.close()
        if not metrics:  # a finished run resumed from a checkpoint saved before evaluations were recorded
            metrics, _ = self._evaluate(unwrap_model(model), step=pos.step)  # the last evaluation was of these weights
        rate = self.trained.overall_rate  # one rank's, over every process; None when a checkpoint kept no counts
        results = {
            **self._summary(), **metrics, "top1_best": pos.best, "epochs": cfg.train.epochs,
            "train_images_per_s": None if rate is None else rate * dist.world_size,
            "train_steps": pos.step, "skipped_steps": guard.skipped,
            "completed": not (cfg.train.stop_after_epoch and cfg.train.stop_after_epoch < cfg.train.epochs),
        }
        if dist.is_main:
            write_results(self.run_dir, results)
        return results

    def _preempted(self, step: int) -> Preempted:
        """After the checkpoint of ``step`` is saved: results.json of a preempted run, and the exception to raise."""
        if self.dist.is_main:
            write_results(self.run_dir, {**self._summary(), "completed": False, "preempted": True,
                                         "train_steps": step, "epochs": self.cfg.train.epochs})
        return self.stop.preempted(step)

    def _rank0_total(self, sums: torch.Tensor) -> torch.Tensor:
        """The running sums of every rank, on rank 0 (zeros elsewhere): what a checkpoint saves, so that
        the epoch's all-reduce after a resume counts each rank's share once."""
        total = all_reduce_sum(sums.clone()).cpu()
        return total if self.dist.is_main else torch.zeros_like(total)

    def _stop_requested(self) -> bool:
        """Whether a stop signal reached any rank (one all-reduce, so every rank gives the same answer)."""
        flag = torch.tensor([float(self.stop.requested)], device=self.device, dtype=torch.float64)
        return all_reduce_sum(flag).item() > 0

    def _settle_saved_evaluation(self, found: Checkpoint, pending_row: dict[str, Any] | None, model, ema,
                                 pos: _Position, logger: MetricsLogger) -> dict[str, float]:
        """On resume from ``found``: the metrics of the evaluation after its save ({} when there was none),
        running it first when the run stopped before recording it. metrics.csv keeps its rows up to the
        checkpoint, this epoch's row exactly once."""
        record = found.evaluation() if pending_row is not None else None
        if pending_row is None or record is not None:
            logger.drop_after(pos.step)
            if record is None:
                return {}
            pos.best = record["best_top1"]
            return record["metrics"]
        logger.drop_after(pos.step - 1)  # the row, if the stop came after logging it, is logged again
        log.info("evaluating epoch %d first: the run stopped before its evaluation was recorded", pos.epoch)
        return self._evaluate_saved_epoch(model, ema, pending_row, pos, logger)

    def _evaluate_saved_epoch(self, model, ema, row: dict[str, Any], pos: _Position,
                              logger: MetricsLogger) -> dict[str, float]:
        """The evaluation of the epoch just saved (``pos.epoch`` epochs, step ``pos.step``): logs ``row``
        with the metrics, records them in the checkpoint, then acts on a stop signal that came meanwhile."""
        try:
            metrics = self._evaluate_epoch(model, ema, row, pos, pos.epoch - 1)
        except Preempted:  # the checkpoint is saved with this evaluation pending: a resume runs it
            raise self._preempted(pos.step) from None
        logger.log(row)
        if self.dist.is_main:
            record_evaluation(self.run_dir, pos.step, {"metrics": metrics, "best_top1": pos.best})
        if self._stop_requested():
            raise self._preempted(pos.step)
        return metrics

    def _evaluate_epoch(self, model, ema, row: dict[str, Any], pos: _Position, epoch: int) -> dict[str, float]:
        """Evaluate after an epoch: fills ``row``, updates ``pos.best``, saves best.safetensors."""
        cfg, dist = self.cfg, self.dist
        metrics, load = self._evaluate(unwrap_model(model), with_head_load=self.routed, step=pos.step)
        row.update(metrics)
        pos.best = max(pos.best, metrics["top1"])
        if load is not None:
            row.update({f"head_load/layer{i}": np.mean(layer, axis=0).tolist() for i, layer in enumerate(load["load"])})
            if dist.is_main:
                write_json(self.run_dir / HEAD_LOAD_FILE, load)
        if ema is not None:
            row["top1_ema"] = evaluate(ema.module, self.val_loader, self.device, cfg.data.num_classes,
                                       self.amp_dtype, stop=self.stop, step=pos.step)["top1"]
        weights = unwrap_model(model).state_dict()
        require_finite(weights, BEST_WEIGHTS, pos.step)  # on every rank, so all of them stop together
        if metrics["top1"] >= pos.best and dist.is_main:
            save_weights(self.run_dir / BEST_WEIGHTS, weights, {"epoch": str(epoch + 1), "top1": str(metrics["top1"])})
        log.info("epoch %d/%d: loss %.4f top1 %.4f top5 %.4f (best %.4f)", epoch + 1, cfg.train.epochs,
                 row["loss"], metrics["top1"], metrics["top5"], pos.best)
        return metrics

    def _save_last(self, model, optimizer, ema, guard: NonFiniteGuard, pos: _Position,
                   pending_row: dict[str, Any] | None = None) -> None:
        """Save the checkpoint of ``pos``; ``pending_row``: the epoch's metrics row, its evaluation to follow."""
        weights = {MODEL_WEIGHTS: unwrap_model(model).state_dict()}
        if ema is not None:
            weights[EMA_WEIGHTS] = ema.state_dict()
        for name, tensors in weights.items():
            require_finite(tensors, name, pos.step)  # on every rank, so all of them stop together
        rngs = all_gather_object(rng_state())  # every rank's generators
        if self.dist.is_main:
            state = {
                "step": pos.step, "epoch": pos.epoch, "batches": pos.batches, "epoch_sums": pos.sums,
                "best_top1": pos.best, "world_size": self.dist.world_size, "optimizer": optimizer.state_dict(),
                "rng": rngs, "guard": guard.state_dict(), "pending_eval_row": pending_row,
                "throughput": self.trained.state_dict(), "clock": self.clock.state_dict(),
                "amp": self.amp.record(), RECORD_KEY: self.train_paths,
            }
            save_checkpoint(self.run_dir, pos.step, weights, state,
                            run=self.definition)
        barrier()

    def _resume(self, found: Checkpoint, state: dict[str, Any], optimizer, ema,
                guard: NonFiniteGuard) -> tuple[_Position, dict[str, Any] | None]:
        """Load ``found`` (its ``state()`` read); returns the position and the metrics row of an
        evaluation it left pending."""
        self.model.load_state_dict(found.weights(MODEL_WEIGHTS))
        optimizer.load_state_dict(state["optimizer"])
        if ema is not None and EMA_WEIGHTS in found.files:
            ema.load_state_dict(found.weights(EMA_WEIGHTS))
        guard.load_state_dict(state.get("guard"))
        self.trained.load_state_dict(state.get("throughput"))
        self.clock.load_state_dict(state.get("clock"))
        if state["world_size"] == self.dist.world_size:
            set_rng_state(state["rng"][self.dist.rank])
        else:
            log.warning("resuming with %d processes, saved with %d: data order and augmentation differ",
                        self.dist.world_size, state["world_size"])
        log.info("resumed from %s at epoch %d, batch %d (step %d)", found.path, state["epoch"], state["batches"],
                 state["step"])
        sums = state["epoch_sums"] if self.dist.is_main else torch.zeros_like(state["epoch_sums"])  # see _rank0_total
        pos = _Position(state["epoch"], state["batches"], state["step"], state["best_top1"], sums)
        return pos, state.get("pending_eval_row")

    def _summary(self) -> dict[str, Any]:
        model = self.model
        active, total = active_heads(model)
        sample = torch.zeros(1, self.cfg.data.in_chans, self.cfg.data.image_size, self.cfg.data.image_size,
                             device=self.device)
        return {
            "task": "cls", "mode": self.cfg.mode, "attn": self.cfg.attn.name, "attn_spec": attn_spec(self.cfg),
            "model": self.cfg.model.name, "budget": budget_name(self.cfg), "data": self.cfg.data.name,
            "seed": self.cfg.seed, "world_size": self.dist.world_size,
            "active_heads": [active, total], "active_ratio": active / max(total, 1),
            "params": count_params(model), "flops_per_image": model_flops(model, sample),
            "active_head_flops_per_image": active_head_flops(model, sample),
            "peak_memory_mb": peak_memory_mb(self.device), **self.clock.record(self.device),
            "run_dir": str(self.run_dir), **self.amp.record(), "tf32": self.tf32,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "attention_paths": impl_choices(model),  # which exact path each layer ran (MoH impl=auto's probe)
            RECORD_KEY: self.train_paths,  # and which path each MoH layer trained on
            # data.bad_images=skip: what this process left out (each rank verifies and skips alike)
            "skipped_files": skipped_files(self.train_set, self.val_set),
            **self.resume_notes,
        }


@dataclass
class ClsStep:
    """One training step of the loop, from a batch on the device to the update (``python -m
    visattn.bench loop`` times this same step): Mixup / CutMix, the learning rate, forward and task +
    beta * aux loss under ``autocast()``, backward, ``clip_and_norm``, the gate's decision, then the
    optimizer step, the EMA and the epoch's sums (loss, aux, batches), each applied only where the
    gate lets it, on the device: nothing here waits for the device. Returns (task loss, lr)."""

    model: nn.Module  # as trained (DDP and / or compiled)
    optimizer: torch.optim.Optimizer
    ema: ModelEMA | None
    gate: StepGate
    schedule: WarmupSchedule
    criterion: nn.Module
    autocast: Callable[[], AbstractContextManager]
    aux_weight: float
    clip: float | None
    mixup: Callable | None = None

    def __call__(self, step: int, images: torch.Tensor, labels: torch.Tensor,
                 sums: torch.Tensor) -> tuple[torch.Tensor, float]:
        if self.mixup is not None:
            images, labels = self.mixup(images, labels)
        lr = self.schedule.apply(self.optimizer, step)
        with self.autocast():
            logits = self.model(images)
            task = self.criterion(logits.float(), labels)
        aux = aux_loss(self.model)
        loss = task + self.aux_weight * aux
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = clip_and_norm(self.model.parameters(), self.clip)
        apply = self.gate.check(step, loss, norm)
        optimizer_step(self.optimizer, apply)
        if self.ema is not None:
            self.ema.update(self.model, apply)
        batch = torch.stack([task.detach(), aux.detach().to(task.dtype), torch.ones_like(task)]).to(sums.dtype)
        sums += torch.where(apply, batch, 0.0)
        return task, lr


def run_cls(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Validate ``cfg``, then train or evaluate; returns what ``results.json`` holds. Raises
    ``Preempted`` after saving on a stop signal, ``NonFiniteError`` when training diverged."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_cls_config(cfg, world_size)
    refuse_to_overwrite_training(run_dir, cfg.mode)
    resume_dir = cfg.resume if isinstance(cfg.resume, str) and cfg.resume != "auto" else run_dir
    with launched(cfg.device, cfg.train.num_threads, resume_dir, OmegaConf.to_container(cfg, resolve=True)) as ctx:
        run = ClsRun(cfg, ctx)
        results = run.eval() if cfg.mode == "eval" else run.train()
        barrier()
        return results
