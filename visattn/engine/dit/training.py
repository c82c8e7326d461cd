"""DiT training loop (``mode=train``): AdamW at a constant lr (DiT's; or ``sched``), EMA, hybrid
diffusion loss + beta * MoH load-balancing loss, DDP under torchrun, the non-finite guard,
checkpoints (``checkpoints``), preemption, then head load and the final sampling + scoring with
the EMA model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.auto import tqdm

import visattn
from visattn.data.registry import class_names
from visattn.diffusion import GaussianDiffusion, conditional_fn
from visattn.engine.amp import StepProbe, apply_tf32, choose_amp
from visattn.engine.checkpoints import (
    EMA_WEIGHTS,
    MODEL_WEIGHTS,
    Checkpoint,
    checkpoint_to_resume,
    save_checkpoint,
)
from visattn.engine.distributed import (
    DistInfo,
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_module,
)
from visattn.engine.dit.data import EpochBatches, build_train_data, to_device
from visattn.engine.dit.evaluation import evaluate_model, run_info
from visattn.engine.dit.sampling import build_scorer
from visattn.engine.dit.setup import build_diffusion, build_model
from visattn.engine.ema import ModelEMA, unwrap_model
from visattn.engine.guard import GRADIENTS, NonFiniteGuard, cause_hint, require_finite
from visattn.engine.head_load import HEAD_LOAD_FILE, HeadLoadMeter
from visattn.engine.launch import seed_everything
from visattn.engine.moh_paths import RECORD_KEY, saved_train_paths, settle_train_paths
from visattn.engine.optim import WarmupSchedule, adamw
from visattn.engine.preempt import StopSignal
from visattn.engine.results import (
    RunClock,
    Throughput,
    write_json,
)
from visattn.engine.run_identity import run_definition
from visattn.engine.runlog import MetricsLogger
from visattn.engine.step import StepGate, clip_and_norm, compiled, optimizer_step
from visattn.utils.checkpoint import rng_state, set_rng_state

log = logging.getLogger(__name__)


def save_training_checkpoint(
    run_dir: Path, model: nn.Module, ema: ModelEMA, opt, step: int, batches: EpochBatches, dist: DistInfo,
    guard: NonFiniteGuard, extra: Mapping[str, Any] | None = None, timer: Throughput | None = None,
    clock: RunClock | None = None, loss_window: torch.Tensor | None = None, run: Mapping[str, Any] | None = None,
) -> None:
    """One checkpoint unit (``checkpoints/step-N/``: model + EMA weights, optimizer, step, data
    position, every rank's RNG, the guard's counts, ``extra`` (e.g. fid_step0) and the loss sums of
    the steps since the last log row, over all ranks); rank 0 writes. Non-finite weights are refused
    on every rank before anything is written."""
    weights = {MODEL_WEIGHTS: unwrap_model(model).state_dict(), EMA_WEIGHTS: ema.state_dict()}
    for name, tensors in weights.items():
        require_finite(tensors, name, step)
    rngs = all_gather_object(rng_state())
    window = all_reduce_sum(loss_window.clone()).tolist() if loss_window is not None else None
    if dist.is_main:
        save_checkpoint(run_dir, step, weights, {
            "optimizer": opt.state_dict(),
            "step": step,
            "data_position": [batches.epoch, batches.taken],
            "rng": rngs,
            "guard": guard.state_dict(),
            "extra": dict(extra or {}),
            "throughput": timer.state_dict() if timer is not None else None,
            "clock": clock.state_dict() if clock is not None else None,
            "loss_window": window,
        }, run=run)
    barrier()


def restore_training_checkpoint(
    found: Checkpoint, model: nn.Module, ema: ModelEMA, opt, batches: EpochBatches, dist: DistInfo,
    guard: NonFiniteGuard, timer: Throughput | None = None, clock: RunClock | None = None,
    loss_window: torch.Tensor | None = None,
) -> tuple[int, dict[str, Any]]:
    """Load what ``save_training_checkpoint`` wrote; returns (step, extra). ``loss_window`` (rank 0's)
    takes the saved sums, so the first log row after a resume averages every step since the last row."""
    state = found.state()
    if loss_window is not None and dist.is_main and state.get("loss_window") is not None:
        loss_window.copy_(torch.tensor(state["loss_window"], dtype=loss_window.dtype))
    if timer is not None:
        timer.load_state_dict(state.get("throughput"))
    if clock is not None:
        clock.load_state_dict(state.get("clock"))
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


def train(cfg: Mapping[str, Any], dist: DistInfo, run_dir: Path, stop: StopSignal,
          clock: RunClock | None = None) -> dict[str, Any]:
    """Train (resuming from the run's latest checkpoint), then measure head load and score; ``clock``
    (this process's) is kept in the checkpoints so that it covers every process of the run."""
    tcfg = cfg["train"]
    seed = int(cfg["seed"])
    tf32 = apply_tf32(bool(tcfg.get("tf32", True)), dist.device)
    seed_everything(seed * 1000)
    data = build_train_data(cfg)
    model = build_model(cfg).to(dist.device)
    broadcast_module(model)  # every rank starts from rank 0's weights, before the EMA copies them
    if dist.rank:
        seed_everything(seed * 1000 + dist.rank)  # label dropout, flips, t and noise differ per rank
    if tuple(data.sample_shape) != (model.in_channels, model.input_size, model.input_size):
        raise ValueError(f"data samples are {tuple(data.sample_shape)} but the model takes "
                         f"{(model.in_channels, model.input_size, model.input_size)}; check data/vae settings")
    check_labels(data.labels, model.num_classes)
    diffusion = build_diffusion(cfg, model.learn_sigma)
    ema = ModelEMA(model, float(tcfg["ema_decay"]))
    opt = adamw(model.parameters(), dist.device, lr=float(tcfg["lr"]), weight_decay=float(tcfg["weight_decay"]))
    global_batch = int(tcfg["batch_size"])
    if global_batch % dist.world_size:
        raise ValueError(f"train.batch_size={global_batch} is not divisible by the {dist.world_size} processes")
    batches = EpochBatches(len(data), global_batch // dist.world_size, dist, seed)
    schedule = lr_schedule(cfg, len(data))
    info = run_info(model, cfg, dist)
    log.info("%s: %.2fM parameters, %d/%d heads active, %d training images",
             cfg["dit"]["preset"], info["params"] / 1e6, *info["active_heads"], len(data))

    guard = NonFiniteGuard(int(tcfg["max_nonfinite_steps"]),
                           cause_hint(float(tcfg["lr"]), str(tcfg["amp"]), cfg["data"]["name"]))
    step = 0
    results: dict[str, Any] = {}
    timer = Throughput(dist.device)  # over every process that trained this run (kept in the checkpoints)
    # before the checkpoint's RNG is restored: building the extractor draws from torch's generator
    scorer = build_scorer(cfg) if cfg["eval"]["enabled"] and dist.is_main else None
    running = torch.zeros(3, device=dist.device)  # loss, aux, count since the last log
    found = checkpoint_to_resume(cfg.get("resume"), run_dir)
    if found is not None:
        step, extra = restore_training_checkpoint(found, model, ema, opt, batches, dist, guard, timer, clock,
                                                  loss_window=running)
        results.update(extra)
        log.info("resumed from %s at step %d", found.path, step)
    metrics = MetricsLogger(run_dir, tensorboard=bool(tcfg.get("tensorboard", True)), enabled=dist.is_main)
    metrics.drop_after(step)

    if step == 0 and cfg["eval"]["enabled"] and cfg["eval"]["fid_step0"]:
        scores = evaluate_model(ema.module, cfg, dist, run_dir, scorer, save=False, stop=stop, step=0)
        if dist.is_main:
            results["fid_step0"] = scores["fid"]
            log.info("step 0: FID %.2f", scores["fid"])

    model.train()
    total_steps = int(tcfg["steps"])
    aux_weight = float(tcfg["aux_loss_weight"])
    probe = step_probe(model, diffusion, data.sample_shape, global_batch // dist.world_size, aux_weight, dist.device)
    amp = choose_amp(tcfg["amp"], dist.device, probe, saved=results if found is not None else None)
    results.update(amp.record())  # in every checkpoint's extra: a resume keeps this choice
    results[RECORD_KEY] = settle_train_paths(model, tcfg.get("attn_paths", "dense"), probe.loss,
                                             lambda: amp.autocast(dist.device),
                                             saved_train_paths(results if found is not None else None),
                                             compile=bool(tcfg.get("compile", False)))  # kept the same way
    ddp = DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None) \
        if dist.distributed else model
    clip = tcfg.get("clip_grad")
    gate = StepGate(guard, stop, dist.device, grad_what="gradient norm" if clip else GRADIENTS)
    train_step = DiTStep(compiled(ddp, tcfg.get("compile", False)), model, diffusion, opt, ema, gate, schedule,
                         amp.autocast(dist.device), aux_weight, clip, running)
    stream = iter(batches)
    timed_images = 0  # since the timer's span started; the span ends (one sync) at a log or a save
    bar = tqdm(total=total_steps, initial=step, desc="train", disable=not (tcfg["progress"] and dist.is_main),
               dynamic_ncols=True)
    definition = run_definition(cfg)
    while step < total_steps:
        if not timer.running:
            timer.start()
        x, y = to_device(*data.batch(next(stream)), dist.device)
        train_step(step, x, y)
        timed_images += x.shape[0] * dist.world_size
        step += 1
        stop_now = gate.stop_now()
        log_now = step % int(tcfg["log_every"]) == 0 or step == total_steps
        save_now = step % int(tcfg["ckpt_every"]) == 0 or step == total_steps or stop_now
        if log_now or save_now:
            gate.sync(step)  # the host's read of the guard: NonFiniteError here (before any save) past the limit
            timer.stop(timed_images)
            timed_images = 0
        bar.update(1)
        if log_now:
            loss_mean, aux_mean, count = all_reduce_sum(running).tolist()
            loss_mean, aux_mean = (loss_mean / count, aux_mean / count) if count else (math.nan, math.nan)
            running.zero_()
            rate = timer.lap()  # since the last log row
            row = {"step": step, "epoch": batches.epoch, "loss": loss_mean, "aux_loss": aux_mean,
                   "lr": opt.param_groups[0]["lr"], "images_per_s": rate, "skipped_steps": guard.skipped}
            metrics.log(row)
            bar.set_postfix(loss=f"{loss_mean:.4f}", aux=f"{aux_mean:.3f}")
            if dist.is_main:
                log.info("step %d/%d: loss %.4f aux %.3f (%.1f images/s)", step, total_steps, loss_mean,
                         aux_mean, rate)
        if save_now:
            save_training_checkpoint(run_dir, model, ema, opt, step, batches, dist, guard, extra=results,
                                     timer=timer, clock=clock, loss_window=running, run=definition)
        if stop_now:
            bar.close()
            metrics.close()
            raise stop.preempted(step)
    bar.close()
    metrics.close()
    results.update(info)
    # rate and seconds over every step of the run, all processes (None after resuming from a checkpoint
    # without the counts)
    results.update({"train_steps": step, "train_images_per_s": timer.overall_rate,
                    "train_wall_time_s": timer.seconds if timer.complete else None,
                    "skipped_steps": guard.skipped, "tf32": tf32})
    active, total = info["active_heads"]
    if active < total and cfg["eval"]["head_load_images"] > 0:  # only models that select heads per token have a load
        load = measure_head_load(ema.module, data, diffusion, cfg, dist)
        if dist.is_main:
            write_json(run_dir / HEAD_LOAD_FILE, load)
    if cfg["eval"]["enabled"]:
        results.update(evaluate_model(ema.module, cfg, dist, run_dir, scorer, save=True, stop=stop, step=step))
    results["attention_paths"] = visattn.attention.impl_choices(ema.module)  # after the evaluation's forwards
    return results


@dataclass
class DiTStep:
    """One training step of the loop, from a batch on the device to the update (``python -m
    visattn.bench loop`` times this same step): the hybrid diffusion loss + beta * aux loss under
    ``autocast``, backward, ``clip_and_norm``, the gate's decision, then the optimizer step, the EMA
    and the loss sums (``running``: loss, aux, count), each applied only where the gate lets it, on
    the device: nothing here waits for the device."""

    forward: nn.Module  # the model as trained (DDP and / or compiled)
    model: nn.Module
    diffusion: GaussianDiffusion
    opt: torch.optim.Optimizer
    ema: ModelEMA
    gate: StepGate
    schedule: WarmupSchedule
    autocast: Any
    aux_weight: float
    clip: float | None
    running: torch.Tensor

    def __call__(self, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = torch.randint(0, self.diffusion.num_timesteps, (x.shape[0],), device=x.device)
        self.schedule.apply(self.opt, step)
        with self.autocast:
            terms = self.diffusion.training_losses(conditional_fn(self.forward, y), x, t)
            diffusion_loss = terms["loss"].mean()
            aux = visattn.aux_loss(self.model)
            loss = diffusion_loss + self.aux_weight * aux
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = clip_and_norm(self.model.parameters(), self.clip)
        apply = self.gate.check(step, loss, norm)
        optimizer_step(self.opt, apply)
        self.ema.update(self.model, apply)
        sums = torch.stack([diffusion_loss.detach().float(), aux.detach().float(), torch.ones_like(self.running[0])])
        self.running += torch.where(apply, sums, 0.0)
        return apply


def check_labels(labels: torch.Tensor, num_classes: int) -> None:
    """ValueError unless every training label is a class of the model: label ``num_classes`` is
    classifier-free guidance's null class, so one out of range would train silently wrong."""
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"the training labels run from {int(labels.min())} to {int(labels.max())} but the model has "
                         f"data.num_classes={num_classes} classes (0..{num_classes - 1}; {num_classes} is guidance's "
                         f"null class); set data.num_classes to the dataset's class count")


def lr_schedule(cfg: Mapping[str, Any], num_images: int) -> WarmupSchedule:
    """``sched`` (the classification vocabulary: warm-up in epochs of the training set, then
    constant or cosine to ``min_lr``) over ``train.steps`` updates at ``train.lr``."""
    sched, steps = cfg["sched"], int(cfg["train"]["steps"])
    steps_per_epoch = num_images / int(cfg["train"]["batch_size"])
    warmup = round(float(sched["warmup_epochs"]) * steps_per_epoch)
    if warmup >= steps and warmup > 0:
        raise ValueError(f"sched.warmup_epochs={sched['warmup_epochs']} is {warmup} steps of {num_images} images "
                         f"at batch {cfg['train']['batch_size']}, no fewer than train.steps={steps}; lower it")
    return WarmupSchedule(float(cfg["train"]["lr"]), steps, warmup, float(sched["warmup_lr"]),
                          float(sched["min_lr"]), sched["name"])


def step_probe(model: nn.Module, diffusion: GaussianDiffusion, sample_shape, batch: int, aux_weight: float,
               device: torch.device) -> StepProbe:
    """A training step of ``model`` on random samples of the run's per-process batch shape, for
    ``train.amp=auto`` to time. The batch is drawn when the probe runs (only ``auto`` on CPU does),
    from its own generator: the run's random streams are left as they are."""

    def loss() -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(batch, *sample_shape, generator=gen).to(device)
        y = torch.randint(0, model.num_classes, (batch,), generator=gen).to(device)
        t = torch.randint(0, diffusion.num_timesteps, (batch,), generator=gen).to(device)
        return diffusion.training_losses(conditional_fn(model, y), x, t)["loss"].mean() + aux_weight * visattn.aux_loss(model)

    return StepProbe(model, loss)


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
        for chunk in indices.split(int(cfg["sample"]["batch_size"])) if len(indices) else ():  # a rank may get none
            x, y = data.batch(chunk)
            t = torch.randint(0, diffusion.num_timesteps, (len(chunk),), generator=gen)
            x_t = diffusion.q_sample(x, t, torch.randn(x.shape, generator=gen))
            model(x_t.to(dist.device), t.to(dist.device), y.to(dist.device))
            meter.update(y.to(dist.device))
    return meter.reduce(class_names(cfg["data"]["name"], int(cfg["data"]["num_classes"])))
