"""``python -m visattn.bench paths``: every exact MoH inference path, ``impl="auto"`` and head-choice
routing, against ``mha`` at given layer shapes.

Per shape, dtype and budget, interleaved in the same rounds: MoH (token choice) through each path it
has (masked dense, dense projections, sparse projections) and through ``auto``; head-choice MoH
through its paths (masked dense, dense projections, head gather) and ``auto``. Rows give the
inference time relative to ``mha`` and to the masked dense path of the same routing and budget, and
for ``auto`` the path its probe chose. Inference only (eval, no grad). ``--paths`` and ``--routings`` time
only some of the rows (shorter rounds, so more of them in the same time).

The reference stays ``mha`` as users run it (timm's layer: SDPA, an addmm with qkv's bias). A second
MHA row, ``mha kernel_parts``, computes the same layer with the parts MoH's kernel paths use
(``MHAOnKernelParts``; float32, and bf16 where the CPU has AMX): where it beats ``mha``, that much of
MoH's margin comes from those parts, not from the heads it skips.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from visattn.attention import build_attention, impl_choices
from visattn.attention.moh import PATHS
from visattn.attention.sparse import compute_dtype, matmul_param
from visattn.kernels import moh_routed_attention_op

from .attention import AttentionCase, Shape, build_attention_workload, moh_budget
from .measure import measure_cases
from .report import ratio_cell
from .timing import median, paired_ratio, ratio_interval
from .workload import DTYPES, Workload

ROUTINGS = {"moh": "token_choice", "hc": "head_choice"}  # label prefix -> routing
KERNEL_PARTS_ROW = "kernel_parts"
KERNEL_PARTS = f"mha {KERNEL_PARTS_ROW}"
# the rows --paths may keep: MoH's paths (every layer's, whichever it has), auto, and the second MHA row
PATH_CHOICES = (*PATHS, "auto", KERNEL_PARTS_ROW)


class MHAOnKernelParts(torch.nn.Module):
    """An ``mha`` layer computed as ``routed_kernel_dense`` computes MoH in inference, every head on: one
    matmul without qkv's bias (the keys' cancels in the softmax; the kernel adds the queries' and the
    values'), the attention in ``moh_routed_attention`` (float32: fused AVX-512 loops where the CPU has
    them; bfloat16: AMX tiles), one output matmul. Equal to ``mha`` to float rounding. Elsewhere (a dtype
    the op does not run here, no kernels, gradients, qk norms) it is the ``mha`` layer itself.
    x: [B, N, C] -> [B, N, dim_out]."""

    def __init__(self, mha: torch.nn.Module) -> None:
        super().__init__()
        self.mha = mha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mha = self.mha
        plain = isinstance(mha.q_norm, torch.nn.Identity) and isinstance(mha.k_norm, torch.nn.Identity)
        if torch.is_grad_enabled() or not plain or x.device.type != "cpu":
            return mha(x)  # first: on a GPU the CPU kernels are not even built
        dtype = compute_dtype(x)
        op = moh_routed_attention_op(dtype, mha.head_dim)
        if op is None:
            return mha(x)
        B, N, _ = x.shape
        T, H, d, Hkv = B * N, mha.num_heads, mha.head_dim, mha.num_kv_heads
        widths = [mha.attn_dim, mha.kv_dim, mha.kv_dim]
        q, k, v = torch.nn.functional.linear(x.to(dtype).contiguous(), matmul_param(mha.qkv.weight, dtype)).split(
            widths, dim=-1
        )
        q_b, _, v_b = mha.qkv.bias.float().split(widths) if mha.qkv.bias is not None else (None, None, None)
        k, v = (t.view(B, N, Hkv, d).transpose(1, 2) for t in (k, v))
        z = q.new_empty(T, H * d)
        no_routed = torch.zeros(0, T, dtype=torch.bool)
        op(q.reshape(T, -1), q_b, k, v, v_b, no_routed, torch.ones(T, H), H, 0, z)
        bias = matmul_param(mha.proj.bias, dtype) if mha.proj.bias is not None else None
        return torch.nn.functional.linear(z, matmul_param(mha.proj.weight, dtype), bias).view(B, N, -1)


@dataclass(frozen=True)
class LayerMix:
    """A budget that is no whole number of a layer's heads (75% of 6), as a model reaches it: a share ``weight``
    of its layers at the nearest whole number (the ``near`` rows, e.g. ``moh-75``: 5 of 6) and the rest at the
    other whole number around it (the ``other`` rows, ``moh-75alt``: 4 of 6), as the released MoH budgets reach
    75% of 6-head layers. Its rows (``label``, ``moh-75mix``) average the two layers' times round by round."""

    label: str
    near: str
    other: str
    weight: float
    active: float  # heads active per token, averaged over the layers


def other_whole_heads(heads: int, fraction: float) -> int | None:
    """The whole number of heads on the other side of ``fraction * heads`` from ``moh_budget``'s nearest one
    (4 for 75% of 6 heads, whose nearest is 5); None where ``fraction * heads`` is a whole number."""
    exact, near = fraction * heads, sum(moh_budget(heads, fraction))
    if abs(exact - near) < 1e-6:
        return None
    return math.floor(exact) if near > exact else math.ceil(exact)


def layer_mixes(heads: int, budgets: list[float], routings: list[str] | None = None) -> list[LayerMix]:
    """The budgets of ``budgets`` that are no whole number of ``heads``, per routing prefix (``ROUTINGS``)."""
    mixes = []
    for fraction in budgets:
        if other_whole_heads(heads, fraction) is None:
            continue
        exact, near = fraction * heads, sum(moh_budget(heads, fraction))
        for prefix in ROUTINGS:
            if routings is None or prefix in routings:
                label = f"{prefix}-{round(100 * fraction)}"
                mixes.append(LayerMix(f"{label}mix", label, f"{label}alt", 1 - abs(exact - near), exact))
    return mixes


def path_cases(
    shape: Shape, budgets: list[float], paths: list[str] | None = None, routings: list[str] | None = None,
    layer_mix: bool = False,
) -> list[AttentionCase]:
    """``mha``, then per budget and routing one row per path of the layer and one for ``auto``
    (labels ``moh-50 masked_dense``, ``hc-75 auto``, ...). ``paths`` keeps only the rows of those names
    (``PATH_CHOICES``; ``kernel_parts`` is the second MHA row) that the layer has, and ``routings`` only those
    label prefixes (``ROUTINGS``); ``mha`` is always timed, as every ratio's reference. Fewer rows make a
    round shorter, so more rounds fit in the same time: what narrows the intervals on a machine whose speed
    drifts. ``layer_mix``: also the layer at the other whole number of heads around a budget that is none
    (``layer_mixes``; rows ``moh-75alt ...``)."""
    for name in paths or []:
        if name not in PATH_CHOICES:
            raise ValueError(f"paths: {name!r} is not a row of this bench; use some of {', '.join(PATH_CHOICES)}")
    for prefix in routings or []:
        if prefix not in ROUTINGS:
            raise ValueError(f"routings: {prefix!r} is not known; use some of {', '.join(ROUTINGS)}")
    wanted = set(PATH_CHOICES if paths is None else paths)
    cases = [AttentionCase("mha", "mha", train=False)]
    if KERNEL_PARTS_ROW in wanted:
        cases.append(AttentionCase(KERNEL_PARTS, "mha", train=False))
    layers = [(f"{round(100 * fraction)}", moh_budget(shape.heads, fraction)) for fraction in budgets]
    for fraction in budgets if layer_mix else []:
        other = other_whole_heads(shape.heads, fraction)
        if other is not None:
            layers.append((f"{round(100 * fraction)}alt", moh_budget(shape.heads, other / shape.heads)))
    for suffix, (shared, topk) in layers:
        for prefix, routing in ROUTINGS.items():
            if routings is not None and prefix not in routings:
                continue
            kwargs = {"shared_heads": shared, "routed_topk": topk, "routing": routing}
            layer_paths = build_attention("moh", shape.dim, num_heads=shape.heads, **kwargs).paths
            for impl in (*layer_paths, "auto"):
                if impl in wanted:
                    kwargs_impl = {**kwargs, "impl": impl}
                    cases.append(AttentionCase(f"{prefix}-{suffix} {impl}", "moh", kwargs_impl, train=False))
    return cases


def _chosen_path(work: Workload, dtype: str) -> str | None:
    """The path an ``impl="auto"`` layer chose for ``dtype`` (None for other rows). One workload serves
    every dtype (bf16 runs under autocast), so the choice is read per dtype, not as the last path run."""
    layers = impl_choices(work.module)["layers"]
    if not layers or layers[0]["impl"] != "auto":
        return None
    compute = str(DTYPES[dtype] or torch.float32).removeprefix("torch.")  # as the probe names it
    chosen = [c["path"] for key, c in layers[0]["choices"].items() if key.endswith(" " + compute)]
    return chosen[-1] if chosen else None


def _versus_masked(rows: list[dict[str, Any]]) -> None:
    """Add ``vs_masked``: inference time over the masked dense row of the same routing, budget, dtype (timed in
    the same rounds: ``timing.paired_ratio``)."""
    masked = {
        (r["label"].split()[0], r["dtype"]): r["infer_samples_ms"]
        for r in rows
        if r["label"].endswith(" masked_dense")
    }
    for r in rows:
        ref = masked.get((r["label"].split()[0], r["dtype"]))
        r["vs_masked"] = paired_ratio(r["infer_samples_ms"], ref) if ref and " " in r["label"] else None


def run_paths_bench(
    shapes: list[Shape],
    budgets: list[float],
    dtypes: list[str],
    warmup: int = 2,
    repeats: int = 10,
    clock: str = "wall",
    device: torch.device | str = "cpu",
    paths: list[str] | None = None,
    routings: list[str] | None = None,
    layer_mix: bool = False,
) -> list[dict[str, Any]]:
    """Rows as ``measure.measure_cases`` gives them (inference keys) plus ``shape``, ``vs_masked`` and
    ``auto_path``; ratios are to ``mha`` in the same interleaved rounds. ``paths`` / ``routings``: only
    those rows (``path_cases``). ``layer_mix``: also a model's mix of layers where a budget is no whole number
    of a layer's heads (``LayerMix``: rows ``moh-75alt`` timed, rows ``moh-75mix`` derived from them)."""
    cases = {str(s): path_cases(s, budgets, paths, routings, layer_mix) for s in shapes}  # bad names: before timing
    rows = []
    for shape in shapes:
        mixes = layer_mixes(shape.heads, budgets, routings) if layer_mix else []
        rows += _shape_rows(shape, cases[str(shape)], dtypes, warmup, repeats, clock, device, mixes)
    return rows


def mix_rows(rows: list[dict[str, Any]], mixes: list[LayerMix]) -> list[dict[str, Any]]:
    """Rows of each ``LayerMix``, one per path both of its layers were timed on (per dtype): per round the
    layers' times weighted by their share of the model's layers (``infer_samples_ms``), and their ratio to
    ``mha`` in the same rounds; ``layers`` names the two rows and their shares."""
    by_label = {(r["label"], r["dtype"]): r for r in rows}
    out = []
    for mix in mixes:
        for (label, dtype), near in by_label.items():
            prefix, _, impl = label.partition(" ")
            other, ref = by_label.get((f"{mix.other} {impl}", dtype)), by_label.get(("mha", dtype))
            if prefix != mix.near or other is None or ref is None:
                continue
            w = mix.weight
            samples = [w * a + (1 - w) * b for a, b in zip(near["infer_samples_ms"], other["infer_samples_ms"],
                                                           strict=True)]
            reference = ref["infer_samples_ms"]
            chosen = [r.get("auto_path") for r in (near, other)]
            out.append({
                "label": f"{mix.label} {impl}", "dtype": dtype, "infer_ms": median(samples),
                "infer_ratio": paired_ratio(samples, reference), "infer_ratio_ci": ratio_interval(samples, reference),
                "infer_samples_ms": samples, "infer_flops": w * near["infer_flops"] + (1 - w) * other["infer_flops"],
                "active_heads": [mix.active, near["active_heads"][1]],
                "layers": {near["label"]: w, other["label"]: round(1 - w, 6)},
                "auto_path": " / ".join(chosen) if all(chosen) else None,
            })  # fmt: skip
    return out


def _shape_rows(
    shape: Shape, shape_cases: list[AttentionCase], dtypes: list[str], warmup: int, repeats: int, clock: str,
    device: torch.device | str, mixes: list[LayerMix] | None = None,
) -> list[dict[str, Any]]:
    """The rows of one layer shape, every case timed in the same interleaved rounds."""
    works: dict[str, Workload] = {}

    def build(label: str, name: str, kwargs: dict[str, Any]) -> Workload:
        works[label] = build_attention_workload(name, kwargs, shape)
        if label == KERNEL_PARTS:
            works[label].module = MHAOnKernelParts(works[label].module)
        return works[label]

    cases = {c.label: (c, (c.label, c.name, c.kwargs)) for c in shape_cases}
    rows = measure_cases(
        cases, build, dtypes, warmup, repeats, train=False, memory=False, reference="mha", clock=clock,
        device=device,
    )
    measured = [r for r in rows if "skipped" not in r]
    for row in measured:
        row["auto_path"] = _chosen_path(works[row["label"]], row["dtype"]) if row["label"].endswith(" auto") else None
    derived = mix_rows(measured, mixes or [])
    _versus_masked(measured + derived)
    return [{"shape": str(shape), **row} for row in rows + derived]


def paths_table(rows: list[dict[str, Any]]) -> str:
    """One markdown table per (shape, dtype): time vs mha and vs the masked dense path, auto's choice."""
    out: list[str] = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if "skipped" not in row:
            groups.setdefault((row["shape"], row["dtype"]), []).append(row)
    for (shape, dtype), members in groups.items():
        out.append(f"\n### {shape}, {dtype}: inference\n")
        out.append("| variant | path | infer ms | vs mha (95% interval) | vs masked dense |")
        out.append("|---|---|---|---|---|")
        for r in members:
            label, _, impl = r["label"].partition(" ")
            path = f"auto -> {r['auto_path']}" if r.get("auto_path") else (impl or "-")
            vs_masked = "-" if r.get("vs_masked") is None else f"{r['vs_masked']:.3f}"
            out.append(f"| {label} | {path} | {r['infer_ms']:.2f} | {ratio_cell(r, 'infer')} | {vs_masked} |")
    skipped = [r for r in rows if "skipped" in r]
    if skipped:
        out.append("\nSkipped:")
        out += [f"- {r['shape']} {r['label']}: {r['skipped']}" for r in skipped]
    return "\n".join(out) + "\n"
