"""``python -m visattn.bench model``: whole presets with each attention, images/s for inference and
training. Presets whose model module is not in the tree are skipped with a message."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .attention import AttentionCase, moh_budget
from .measure import add_images_per_s, measure_cases
from .workload import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPreset:
    module: str  # the visattn module that must exist
    build: Callable[[Any], nn.Module]  # attention spec -> model
    inputs: Callable[[int], tuple[torch.Tensor, ...]]  # batch -> inputs
    heads: Callable[[], list[int]]  # heads per layer or stage, for MoH budgets


def _vit(preset: str) -> ModelPreset:
    def build(attn):
        from visattn.models.vit import VIT_PRESETS, vision_transformer

        return vision_transformer(attn=attn, **VIT_PRESETS[preset])

    def config():
        from visattn.models.vit import VIT_PRESETS

        return VIT_PRESETS[preset]

    def inputs(batch):
        c = config()
        return (torch.randn(batch, c.get("in_chans", 3), c["img_size"], c["img_size"]),)

    return ModelPreset("visattn.models.vit", build, inputs, lambda: [config()["num_heads"]])


def _dit(preset: str) -> ModelPreset:
    def config():
        from visattn.models.dit import dit_preset_config

        return dit_preset_config(preset)

    def build(attn):
        from visattn.models.dit import create_dit

        return create_dit(preset, attn=attn)

    def inputs(batch):
        c = config()
        x = torch.randn(batch, c["in_channels"], c["input_size"], c["input_size"])
        return x, torch.randint(0, 1000, (batch,)), torch.randint(0, c["num_classes"], (batch,))

    def heads():
        h = config()["num_heads"]
        return [h] if isinstance(h, int) else list(h)

    return ModelPreset("visattn.models.dit", build, inputs, heads)


def _transnext(preset: str) -> ModelPreset:
    def build(attn):
        from visattn.models.transnext import create_transnext

        return create_transnext(preset, attn=attn)

    def heads():
        from visattn.models.transnext import PRESETS, stage_heads

        return stage_heads(PRESETS[preset]["embed_dims"], None, 24)

    return ModelPreset("visattn.models.transnext", build, lambda b: (torch.randn(b, 3, 224, 224),), heads)


MODEL_PRESETS: dict[str, ModelPreset] = {
    "vit_small": _vit("small_patch16_224"),
    "vit_tiny": _vit("tiny_patch16_224"),
    "vit_digits": _vit("tiny_patch2_8"),
    "dit_b2": _dit("DiT-B/2"),
    "dit_s2": _dit("DiT-S/2"),
    "transnext_micro": _transnext("transnext_micro"),
}


def attention_spec(label: str, heads: list[int]) -> str | dict[str, Any]:
    """``mha`` / any registered name, or ``moh-<percent>``: MoH with that share of heads active in
    every layer (per-layer lists where head counts differ)."""
    if not label.startswith("moh-"):
        return label
    try:
        fraction = float(label.removeprefix("moh-")) / 100
    except ValueError:
        raise ValueError(f"attention {label!r}: write MoH budgets as moh-<percent>, e.g. moh-50") from None
    budgets = [moh_budget(h, fraction) for h in heads]
    if len(set(budgets)) == 1:
        shared, topk = budgets[0]
        return {"name": "moh", "shared_heads": shared, "routed_topk": topk}
    return {"name": "moh", "shared_heads": [s for s, _ in budgets], "routed_topk": [k for _, k in budgets]}


def build_model_workload(preset: str, attn_label: str, batch: int, seed: int = 0, use_kernels: bool = True) -> Workload:
    """The model with the attention and random inputs of ``batch`` images (module-level: pickled
    into memory probes); ``use_kernels=False`` runs it with ``visattn.kernels`` off."""
    spec = MODEL_PRESETS[preset]
    torch.manual_seed(seed)
    model = spec.build(attention_spec(attn_label, spec.heads()))
    work = Workload(model, spec.inputs(batch))
    work.use_kernels = use_kernels
    return work


def run_model_bench(
    presets: list[str],
    attns: list[str],
    batch: int,
    dtypes: list[str],
    warmup: int = 1,
    repeats: int = 5,
    train: bool = True,
    memory: bool = True,
    clock: str = "wall",
    device: torch.device | str = "cpu",
    compile: bool = False,
    compare_kernels: bool = False,
) -> list[dict[str, Any]]:
    """Rows as ``measure_cases`` gives them plus ``preset``, ``infer_images_per_s`` and
    ``train_images_per_s``; the first attention of ``attns`` is the reference of the ratios.
    ``compare_kernels``: each attention also as ``<attn> pytorch``, with ``visattn.kernels`` off, in the same
    rounds (the reference too: its small heads may run the kernels' attention, ``visattn.attention.small_heads``)."""
    rows: list[dict[str, Any]] = []
    for preset in presets:
        if preset not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; known: {', '.join(MODEL_PRESETS)}")
        module = MODEL_PRESETS[preset].module
        if importlib.util.find_spec(module) is None:
            log.warning("skipping %s: %s is not in the tree yet", preset, module)
            rows.append({"preset": preset, "label": "-", "skipped": f"{module} is not in the tree yet"})
            continue
        cases = {a: (AttentionCase(a, a), (preset, a, batch)) for a in attns}
        if compare_kernels:
            off = {f"{a} pytorch": (AttentionCase(f"{a} pytorch", a), (preset, a, batch, 0, False)) for a in attns}
            cases |= off
        measured = measure_cases(
            cases,
            build_model_workload,
            dtypes,
            warmup,
            repeats,
            train,
            memory,
            reference=attns[0],
            clock=clock,
            device=device,
            compile=compile,
        )
        for row in measured:
            add_images_per_s(row, batch)
            rows.append({"preset": preset, **row})
    return rows
