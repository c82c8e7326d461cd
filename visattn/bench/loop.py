"""``python -m visattn.bench loop``: the engine's training step raced against a bare PyTorch loop.

For each task, the step the training loops run (``engine.cls.trainer.ClsStep``, ``engine.dit.training.DiTStep``: the
gate, the guarded optimizer step and EMA, the loss sums, the learning rate, and the host's read of
the counters every ``--log-every`` steps) and a bare loop of the same model, batch, precision and
optimiser (forward, loss, backward, optimizer step, EMA; nothing else), each on its own copy of the
same initial weights, timed in alternating blocks of ``--log-every`` steps (the order flips every
round, so drift of a shared machine hits both alike). The ratio is the median over rounds of ours /
bare. Where the difference goes: each extra part of our step timed alone, interleaved with its bare
counterpart, on the same state (``parts``): gradient check, gate, optimizer step with ``found_inf``,
masked EMA, loss sums + learning rate + aux loss, and the log-point read amortised over its steps.

Both loops start from a batch already on the device; data loading is the same for both and left out.
"""

from __future__ import annotations

import copy
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from visattn.attention import active_heads, aux_loss

from .timing import CLOCKS, synced

log = logging.getLogger(__name__)

AUX_WEIGHT = 0.01
EMA_DECAY = 0.9999
TASKS = ("cls", "dit")


@dataclass
class LoopRace:
    """One task's two loops and the parts of ours, ready to time. ``ours(i)`` / ``bare(i)``: step
    ``i``; ``ours_log(i)``: what our loop does at a log point after step ``i``. ``parts``: name ->
    (our part, the bare loop's counterpart or None), each callable alone on the current state."""

    task: str
    label: str
    batch: int
    ours: Callable[[int], None]
    ours_log: Callable[[int], None]
    bare: Callable[[int], None]
    parts: dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]] = field(default_factory=dict)


def _kwargs(pairs: list[str] | None) -> dict[str, Any]:
    """``["depth=2", "embed_dim=32"]`` -> {"depth": 2, "embed_dim": 32} (values read as YAML)."""
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"model keyword {pair!r}: write key=value, e.g. depth=2")
        out[key] = yaml.safe_load(value)
    return out


def _precision(dtype_name: str):
    """The engine's ``AmpChoice`` for ``dtype_name`` (fp32: no autocast; bf16: autocast)."""
    from visattn.engine.amp import AmpChoice

    if dtype_name not in ("fp32", "bf16"):
        raise ValueError(f"dtype {dtype_name!r} is not known; use fp32 or bf16")
    return AmpChoice(torch.bfloat16 if dtype_name == "bf16" else None, f"bench: {dtype_name}")


def _routed(model: nn.Module) -> bool:
    active, total = active_heads(model)
    return active < total


def _bare_ema(model: nn.Module) -> Callable[[], None]:
    """timm's ModelEmaV3 update: one foreach lerp over the parameters (buffers copied)."""
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    ema_p, src_p = list(ema.parameters()), list(model.parameters())
    pairs = list(zip(ema.buffers(), model.buffers(), strict=True))

    @torch.no_grad()
    def update() -> None:
        torch._foreach_lerp_(ema_p, src_p, 1.0 - EMA_DECAY)
        for e, b in pairs:
            e.copy_(b)

    return update


def _gate(device: torch.device, clip: float | None):
    from visattn.engine.guard import GRADIENTS, NonFiniteGuard
    from visattn.engine.preempt import StopSignal
    from visattn.engine.step import StepGate

    guard = NonFiniteGuard(5, "the benchmark's random data")
    return StepGate(guard, StopSignal(), device, grad_what="gradient norm" if clip else GRADIENTS)


def _race(task: str, label: str, batch: int, model: nn.Module, opt, ema, gate, schedule, totals: torch.Tensor,
          bare_model: nn.Module, bare_opt, loss_of: Callable[[nn.Module], torch.Tensor], clip: float | None,
          ours: Callable[[int], None], ours_log: Callable[[int], None], log_read: Callable[[], Any]) -> LoopRace:
    """The race of ``ours`` against the bare loop of ``bare_model`` (a copy of ``model`` made before
    any step; ``loss_of(model)``: its task loss under the run's precision), with our extra parts
    (run on ``model``'s state: the gradients of a backward done first) and their bare counterparts."""
    from visattn.engine.step import clip_and_norm, optimizer_step

    routed = _routed(bare_model)
    bare_ema = _bare_ema(bare_model)

    def bare(i: int) -> None:  # forward, loss, backward, step, EMA; clipping only where ours clips
        loss = loss_of(bare_model)
        if routed:
            loss = loss + AUX_WEIGHT * aux_loss(bare_model)
        bare_opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            nn.utils.clip_grad_norm_(bare_model.parameters(), clip)
        bare_opt.step()
        bare_ema()

    held: dict[str, Any] = {}

    def prime() -> None:  # a backward of each, for the parts to work on
        held["task"] = loss_of(model)
        held["loss"] = held["task"] + AUX_WEIGHT * aux_loss(model)
        opt.zero_grad(set_to_none=True)
        held["loss"].backward()
        bare(0)

    def grad_check() -> None:
        held["norm"] = clip_and_norm(model.parameters(), clip)

    def gate_check() -> None:
        held["apply"] = gate.check(0, held["loss"], held["norm"])

    def sums_lr_aux() -> None:  # the loop's loss sums, learning rate and (unrouted: zero) aux loss
        schedule.apply(opt, 0)
        aux = aux_loss(model).detach().to(totals.dtype)
        task = held["task"].detach().to(totals.dtype)
        totals.add_(torch.where(held["apply"], torch.stack([task, aux, torch.ones_like(task)]), 0.0))

    race = LoopRace(task, label, batch, ours, ours_log, bare)
    race.parts = {
        "_prime": (prime, None),
        "grad check" if clip is None else "clip + norm": (
            grad_check, (lambda: nn.utils.clip_grad_norm_(bare_model.parameters(), clip)) if clip else None),
        "gate": (gate_check, None),
        "optimizer (found_inf)": (lambda: optimizer_step(opt, held["apply"]), bare_opt.step),
        "EMA (masked)": (lambda: ema.update(model, held["apply"]), bare_ema),
        "sums + lr + aux": (sums_lr_aux, None),
        "log read": (log_read, None),
    }
    return race


def build_cls(device: torch.device, dtype_name: str, preset: str, batch: int, attn: str,
              kwargs: dict[str, Any], clip: float | None, seed: int = 0) -> LoopRace:
    """Classification: ``ClsStep`` on a ViT preset, label-smoothed cross-entropy, cosine lr."""
    from visattn.engine.cls.trainer import ClsStep
    from visattn.engine.ema import ModelEMA
    from visattn.engine.optim import WarmupSchedule, build_optimizer
    from visattn.models.vit import VIT_PRESETS, vision_transformer

    if preset not in VIT_PRESETS:
        raise ValueError(f"--vit {preset!r} is not a ViT preset; known: {', '.join(VIT_PRESETS)}")
    config = {**VIT_PRESETS[preset], **kwargs}
    torch.manual_seed(seed)
    model = vision_transformer(attn=attn, **config).to(device).train()
    bare_model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, config.get("in_chans", 3), config["img_size"], config["img_size"], generator=gen)
    labels = torch.randint(0, model.num_classes, (batch,), generator=gen)
    images, labels = images.to(device), labels.to(device)
    optim = {"name": "adamw", "lr": 1e-4, "weight_decay": 0.05, "betas": [0.9, 0.999], "eps": 1e-8, "no_decay": []}
    opt, bare_opt = build_optimizer(model, optim, device), build_optimizer(bare_model, optim, device)
    amp = _precision(dtype_name)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    ema, gate = ModelEMA(model, EMA_DECAY), _gate(device, clip)
    schedule = WarmupSchedule(1e-4, 10**9, 0, kind="cosine")
    step = ClsStep(model, opt, ema, gate, schedule, criterion, lambda: amp.autocast(device), AUX_WEIGHT, clip)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    last: dict[str, torch.Tensor] = {}

    def loss_of(net: nn.Module) -> torch.Tensor:
        with amp.autocast(device):
            return criterion(net(images).float(), labels)

    def ours(i: int) -> None:
        last["task"], _ = step(i, images, labels, sums)

    def ours_log(i: int) -> None:  # the loop's read at a log step: the guard's counters and the bar's loss
        gate.sync(i, last["task"])

    return _race("cls", f"{preset} {attn}", batch, model, opt, ema, gate, schedule, sums, bare_model, bare_opt,
                 loss_of, clip, ours, ours_log, lambda: gate.sync(0, sums[0]))


def build_dit(device: torch.device, dtype_name: str, preset: str, batch: int, attn: str | None,
              kwargs: dict[str, Any], clip: float | None, seed: int = 0) -> LoopRace:
    """Generation: ``DiTStep`` on a DiT preset, the hybrid diffusion loss, constant lr (DiT's recipe)."""
    from visattn.diffusion import GaussianDiffusion, conditional_fn
    from visattn.engine.dit.training import DiTStep
    from visattn.engine.ema import ModelEMA
    from visattn.engine.optim import WarmupSchedule, adamw
    from visattn.models.dit import create_dit

    overrides = {**kwargs, **({"attn": attn} if attn is not None else {})}
    torch.manual_seed(seed)
    model = create_dit(preset, **overrides).to(device).train()
    bare_model = copy.deepcopy(model)
    diffusion = GaussianDiffusion.linear(1000, model.learn_sigma)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, model.in_channels, model.input_size, model.input_size, generator=gen).to(device)
    y = torch.randint(0, model.num_classes, (batch,), generator=gen).to(device)
    opt = adamw(model.parameters(), device, lr=1e-4, weight_decay=0.0)
    bare_opt = adamw(bare_model.parameters(), device, lr=1e-4, weight_decay=0.0)
    amp = _precision(dtype_name)
    ema, gate = ModelEMA(model, EMA_DECAY), _gate(device, clip)
    schedule = WarmupSchedule(1e-4, 10**9, 0, kind="constant")
    running = torch.zeros(3, device=device)
    step = DiTStep(model, model, diffusion, opt, ema, gate, schedule, amp.autocast(device), AUX_WEIGHT, clip, running)

    def loss_of(net: nn.Module) -> torch.Tensor:  # DiT's train.py: a timestep per image, the diffusion loss
        t = torch.randint(0, diffusion.num_timesteps, (x.shape[0],), device=device)
        with amp.autocast(device):
            return diffusion.training_losses(conditional_fn(net, y), x, t)["loss"].mean()

    def ours(i: int) -> None:
        step(i, x, y)

    def log_read() -> None:  # the loop's log step: the guard's read, then the loss sums
        gate.sync(0)
        running.tolist()

    def ours_log(i: int) -> None:
        log_read()
        running.zero_()

    return _race("dit", f"{preset} {attn or 'preset attention'}", batch, model, opt, ema, gate, schedule, running,
                 bare_model, bare_opt, loss_of, clip, ours, ours_log, log_read)


def race_loops(race: LoopRace, device: torch.device, rounds: int, warmup: int, log_every: int,
               clock: str = "wall", part_repeats: int = 20) -> dict[str, Any]:
    """Time ``race``: ``warmup`` + ``rounds`` rounds of a block of ``log_every`` steps of each loop (ours
    ending with its log-point read), the order flipped every round; then its parts."""
    now = CLOCKS[clock]
    sync = synced(device, lambda: None)
    step = {"ours": 0, "bare": 0}

    def block(name: str) -> float:
        sync()
        start = now()
        for _ in range(log_every):
            if name == "ours":
                race.ours(step["ours"])
            else:
                race.bare(step["bare"])
            step[name] += 1
        if name == "ours":
            race.ours_log(step["ours"])
        sync()
        return (now() - start) / log_every

    times: dict[str, list[float]] = {"ours": [], "bare": []}
    for r in range(warmup + rounds):
        order = ("ours", "bare") if r % 2 == 0 else ("bare", "ours")
        measured = {name: block(name) for name in order}
        if r >= warmup:
            for name in times:
                times[name].append(measured[name])
    ratios = [o / b for o, b in zip(times["ours"], times["bare"], strict=True)]
    row: dict[str, Any] = {
        "task": race.task, "model": race.label, "batch": race.batch,
        "ours_ms": 1e3 * statistics.median(times["ours"]), "bare_ms": 1e3 * statistics.median(times["bare"]),
        "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "ours_samples_ms": [1e3 * t for t in times["ours"]], "bare_samples_ms": [1e3 * t for t in times["bare"]],
    }
    row["parts_ms"] = time_parts(race, device, part_repeats, log_every, now)
    return row


def time_parts(race: LoopRace, device: torch.device, repeats: int, log_every: int,
               now: Callable[[], float]) -> dict[str, float]:
    """Per step, ms: each part of ours minus its bare counterpart, timed alone and interleaved (median
    of ``repeats``); the log read divided by ``log_every``."""
    parts = dict(race.parts)
    prime, _ = parts.pop("_prime")
    prime()
    ordered = list(parts.items())
    for _, (ours, _bare) in ordered:  # warm-up, in order: each part needs what the one before made
        ours()
    samples: dict[str, list[float]] = {name: [] for name, _ in ordered}
    for _ in range(repeats):
        for name, (ours, bare) in ordered:
            t_ours = _timed(device, ours, now)
            t_bare = _timed(device, bare, now) if bare is not None else 0.0
            samples[name].append(t_ours - t_bare)
    out = {name: 1e3 * statistics.median(values) for name, values in samples.items()}
    out["log read"] /= log_every
    return out


def _timed(device: torch.device, fn: Callable[[], Any], now: Callable[[], float]) -> float:
    synced(device, lambda: None)()
    start = now()
    synced(device, fn)()
    return now() - start


def run_loop_bench(tasks: list[str], device: torch.device, dtypes: list[str], vit: str, vit_batch: int,
                   vit_kwargs: list[str] | None, dit: str, dit_batch: int, dit_kwargs: list[str] | None,
                   attn: str | None, clip: float | None, rounds: int, warmup: int, log_every: int,
                   clock: str = "wall") -> list[dict[str, Any]]:
    rows = []
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"task {task!r} is not known; use {' / '.join(TASKS)}")
        for dtype_name in dtypes:
            if task == "cls":
                race = build_cls(device, dtype_name, vit, vit_batch, attn or "mha", _kwargs(vit_kwargs), clip)
            else:
                race = build_dit(device, dtype_name, dit, dit_batch, attn, _kwargs(dit_kwargs), clip)
            log.info("racing %s: %s, batch %d, %s", task, race.label, race.batch, dtype_name)
            rows.append({**race_loops(race, device, rounds, warmup, log_every, clock), "dtype": dtype_name})
    return rows


def loop_table(rows: list[dict[str, Any]]) -> str:
    head = ("| task | model | batch | dtype | ours ms/step | bare ms/step | ours / bare (median, range over rounds) |\n"
            "|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['task']} | {r['model']} | {r['batch']} | {r['dtype']} | {r['ours_ms']:.2f} | {r['bare_ms']:.2f} | "
             f"{r['ratio']:.3f}x ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) |" for r in rows]
    parts = sorted({name for r in rows for name in r["parts_ms"]}, key=lambda n: list(rows[0]["parts_ms"]).index(n)
                   if n in rows[0]["parts_ms"] else 99)
    where = ("\nWhere the difference goes (ms per step: each part of ours timed alone, minus the bare loop's "
             "counterpart):\n\n| task | dtype | " + " | ".join(parts) + " | sum of parts | measured difference |\n"
             "|---|---|" + "---|" * (len(parts) + 2) + "\n")
    for r in rows:
        p = r["parts_ms"]
        where += (f"| {r['task']} | {r['dtype']} | " + " | ".join(f"{p.get(n, 0.0):+.3f}" for n in parts)
                  + f" | {sum(p.values()):+.3f} | {r['ours_ms'] - r['bare_ms']:+.3f} |\n")
    return head + "\n".join(lines) + "\n" + where
