"""``python -m visattn.bench attention``: every attention variant (and MoH budget) at given shapes.

Per shape and dtype: inference (eval, no grad) and training-step (forward + backward) times as
interleaved medians, the ratio to ``mha`` from the same rounds, FLOPs, fraction of the measured
matmul peak, and (optionally) peak memory in a fresh process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from visattn.attention import build_attention, list_attentions

from .measure import measure_cases
from .workload import Workload


@dataclass(frozen=True)
class Shape:
    """batch, tokens, dim, heads of one attention layer."""

    batch: int
    tokens: int
    dim: int
    heads: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            values = []
        if len(values) != 4 or min(values) < 1:
            raise ValueError(
                f"shape {text!r} must be four positive ints: batch,tokens,dim,heads (e.g. 32,197,384,6)"
            )
        return cls(*values)

    def __str__(self) -> str:
        return f"B={self.batch} N={self.tokens} C={self.dim} H={self.heads}"


@dataclass(frozen=True)
class AttentionCase:
    """One row of the table: a registered variant with its keyword arguments."""

    label: str
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    train: bool = True  # False for rows whose training step is another row's (MoH's masked path)
    infer_impl: str | None = None  # MoH's impl for inference only (training keeps the built one)


def moh_budget(num_heads: int, fraction: float) -> tuple[int, int]:
    """(shared_heads, routed_topk) activating the nearest whole number of heads to ``fraction``.

    As in the released MoH budgets: up to half the heads shared, the rest routed.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"budget {fraction} must be a fraction of heads in (0, 1]")
    active = min(num_heads, max(1, math.floor(fraction * num_heads + 0.5)))
    if active == num_heads:
        return num_heads, 0
    shared = num_heads // 2 if active > num_heads // 2 else active // 2
    return shared, active - shared


def attention_cases(
    heads: int, variants: list[str], budgets: list[float], masked: bool = True
) -> list[AttentionCase]:
    """``mha`` first (the reference), then each variant; ``moh`` once per budget (inference through
    its head-skipping path, ``impl="sparse"``; training as built, on the masked dense path), plus its
    masked dense path (what the released code runs) when ``masked``. ``python -m visattn.bench paths``
    times every MoH path and ``impl="auto"``."""
    known = list_attentions()
    for name in variants:
        if name not in known:
            raise ValueError(f"unknown attention {name!r}; registered: {', '.join(known)}")
    cases = [AttentionCase("mha", "mha")]
    for name in variants:
        if name == "mha":
            continue
        if name != "moh":
            cases.append(AttentionCase(name, name))
            continue
        for fraction in budgets:
            shared, topk = moh_budget(heads, fraction)
            label = f"moh-{round(100 * fraction)}"
            budget = {"shared_heads": shared, "routed_topk": topk}
            cases.append(AttentionCase(label, "moh", budget, infer_impl="sparse"))
            if masked:
                cases.append(
                    AttentionCase(f"{label}-masked", "moh", {**budget, "impl": "dense"}, train=False)
                )
    return cases


def build_attention_workload(
    name: str, kwargs: dict[str, Any], shape: Shape, infer_impl: str | None = None, seed: int = 0
) -> Workload:
    """The layer and a random input x: [batch, tokens, dim] (module-level: pickled into memory probes)."""
    torch.manual_seed(seed)
    module = build_attention(name, shape.dim, num_heads=shape.heads, **kwargs)
    x = torch.randn(shape.batch, shape.tokens, shape.dim)
    return Workload(module, (x,), infer_impl)


def run_attention_bench(
    shapes: list[Shape],
    variants: list[str],
    budgets: list[float],
    dtypes: list[str],
    warmup: int = 2,
    repeats: int = 10,
    train: bool = True,
    memory: bool = True,
    clock: str = "wall",
    masked: bool = True,
    device: torch.device | str = "cpu",
) -> list[dict[str, Any]]:
    """One result row per (shape, dtype, case); see ``measure.measure_cases`` for the keys."""
    rows = []
    for shape in shapes:
        cases = {
            c.label: (c, (c.name, c.kwargs, shape, c.infer_impl))
            for c in attention_cases(shape.heads, variants, budgets, masked)
        }
        measured = measure_cases(
            cases,
            build_attention_workload,
            dtypes,
            warmup,
            repeats,
            train,
            memory,
            reference="mha",
            clock=clock,
            device=device,
        )
        rows.extend({"shape": str(shape), **row} for row in measured)
    return rows
