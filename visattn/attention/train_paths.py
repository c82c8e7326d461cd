"""What each attention layer trains on, chosen once per run by timing: the path of MoH layers under
``impl="auto"``, and for every softmax layer (MHA and MoH alike) SDPA or the small-heads kernel.

In eval ``auto`` probes per input shape (``impl_probe``), and so does the small-heads attention
(``small_heads``). Training differs in two ways. Only a few options compete: for a MoH layer the masked dense
path and ``routed_kernel_loops``, whose compiled backward made the study's MoH-50 ViT train at 0.96-1.00x MHA's
speed where the masked dense path ran at 0.93-0.96x (docs/benchmarks.md; the PyTorch skipping paths train slower
than the masked dense one); for a layer that attends through ``HeadAttention.sdpa`` (the masked dense path's
attention), SDPA or ``small_attention`` (``visattn.attention.small_heads.SmallAttention``: the kernel and its
backward, which also skip MoH's rows gated 0). And a run must not change between its processes: the options agree
only to float rounding, so a resumed run (or another rank) that chose differently would change the run's last
bits. So a run chooses once, at start, on the run's own batch shape: ``choose_train_paths`` times each layer's
forward and backward per option and returns a record; the trainer takes rank 0's, applies it
(``apply_train_paths``), keeps it in results.json and every checkpoint, and a resumed run applies the saved
record instead of probing, as ``train.amp=auto`` does with its choice.

Record: ``{"paths": {layer name: path}, "attention": {layer name: "small_attention"}, "times_ms": {layer name:
{option: best ms}}, "device": ..., "reason": ...}``; MoH layers not named in ``paths`` train on the masked dense
path, layers not named in ``attention`` on SDPA (a record from before ``attention`` existed: SDPA everywhere, as
those runs trained).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from visattn.utils.probing import untouched

from .base import HeadAttention
from .impl_probe import default_timer, device_name, pick_path, time_paths
from .moh import REFERENCE_PATH, TRAIN_PATHS, MoHAttention
from .routed_kernel import kernel_runs
from .small_heads import KERNEL as SMALL_ATTENTION
from .small_heads import REFERENCE as SDPA
from .small_heads import small_attention_fits
from .sparse import compute_dtype

log = logging.getLogger(__name__)

KERNEL_PATH = TRAIN_PATHS[1]


def _auto_layers_with_kernel(model: nn.Module) -> dict[str, MoHAttention]:
    """The MoH layers of ``model`` with ``impl="auto"`` and a kernel path."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, MoHAttention) and m.impl == "auto" and KERNEL_PATH in m.paths}


def probed_layers(model: nn.Module) -> dict[str, MoHAttention]:
    """The MoH layers of ``model`` whose training path a probe chooses: ``impl="auto"`` and a kernel
    path to train on (not with straight-through gates, which train on the masked dense path)."""
    return {name: m for name, m in _auto_layers_with_kernel(model).items() if m.zero_gates_carry_no_grad}


def attention_layers(model: nn.Module) -> dict[str, HeadAttention]:
    """The layers of ``model`` whose attention may train on the small-heads kernel: every ``HeadAttention`` that
    trains through ``sdpa`` (not a MoH layer whose ``impl`` names a path of its own), without attention dropout
    (which the kernel does not apply)."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, HeadAttention) and m.attends_by_sdpa and m.attn_drop.p == 0.0
            and getattr(m, "fixed_path", None) in (None, REFERENCE_PATH)}


def empty_record(reason: str) -> dict[str, Any]:
    """A record that leaves every layer on the masked dense path and SDPA."""
    return {"paths": {}, "attention": {}, "times_ms": {}, "device": device_name("cpu"), "reason": reason}


def choose_train_paths(
    model: nn.Module,
    forward: Callable[[], object],
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    timer: Callable[[str, Callable[[], object]], float] | None = None,
    repeats: int = 5,
    margin: float = 0.02,
    give_up: float = 3.0,
) -> dict[str, Any]:
    """The training path of every probed MoH layer of ``model`` (``probed_layers``) and the attention of every
    ``attention_layers`` layer, as a record (see the module docstring).

    ``forward()`` runs the model on a batch of the run's shape (e.g. the amp probe's loss); it runs
    once, without gradients, in training mode, to capture each layer's input. Then each layer runs
    forward and backward (``torch.autograd.grad``: no ``.grad`` is touched) on that input per option, under
    ``autocast()`` (the run's mixed precision), timed as ``impl_probe`` times (``timer``, ``default_timer`` when
    None; ``repeats``, ``give_up``), and keeps another option than the reference (the masked dense path on SDPA)
    only if it beats it by more than ``margin`` (``pick_path``). The options: ``small_attention`` where the kernel
    fits the layer's attention (float32, small heads, few tokens; ``small_heads``), and for a probed MoH layer
    ``routed_kernel_loops`` where it runs. Layers of one signature and input shape share a measurement. Where
    nothing but the reference runs (bf16, a GPU, no toolchain) nothing is timed. The probe leaves no trace: the
    model's mode, buffers, gradients, the layers' settings and torch's CPU random state are as before.
    """
    moh, attention = probed_layers(model), attention_layers(model)
    layers = {**attention, **moh}
    if not layers:
        return empty_record("no MoH layer with impl=auto and a kernel path, and no softmax attention layer")
    param = next(model.parameters(), None)
    if param is not None and param.device.type != "cpu":
        return empty_record(f"the kernels run on the CPU, the model is on {param.device.type}: masked dense, SDPA")
    inputs = _capture_inputs(model, layers, forward)
    device = device_name(next(iter(inputs.values())).device) if inputs else device_name("cpu")
    record = {"paths": {}, "attention": {}, "times_ms": {}, "device": device,
              "reason": "probe: forward and backward of each layer"}
    shared: dict[tuple, tuple[str, dict[str, float]]] = {}
    with untouched(model, training=True), autocast():
        for name, layer in layers.items():
            x = inputs.get(name)
            options = _options(layer, x, name in moh) if x is not None else {}
            if len(options) < 2:
                continue
            dtype = str(compute_dtype(x)).removeprefix("torch.")
            key = (type(layer), _layer_key(layer, x, device, dtype), tuple(options))
            if key not in shared:
                shared[key] = _time_layer(layer, x, options, timer or default_timer, repeats, margin, give_up)
            choice, times = shared[key]
            if name in moh:
                record["paths"][name] = KERNEL_PATH if choice == KERNEL_PATH else REFERENCE_PATH
            if choice == SMALL_ATTENTION:
                record["attention"][name] = SMALL_ATTENTION
            record["times_ms"][name] = times
    if not record["times_ms"]:
        record["reason"] = "no kernel runs here (dtype, device, shape or toolchain): masked dense, SDPA"
    return record


def apply_train_paths(model: nn.Module, record: Mapping[str, Any]) -> None:
    """Set every probed layer's ``train_path`` and every attention layer's ``train_attention`` from ``record``
    (layers it does not name: masked dense, SDPA). A ValueError names a layer the model lacks or a path a layer
    cannot train on."""
    layers, attention = probed_layers(model), attention_layers(model)
    paths = dict(record.get("paths") or {})
    # Before the 25th session the probe also chose for layers of straight-through gates, whose gradient the kernel
    # path drops for the unselected heads: such a layer now trains on the masked dense path whatever the record says.
    straight_through = set(_auto_layers_with_kernel(model)) - set(layers)
    moved = sorted(name for name in straight_through if paths.pop(name, None) == KERNEL_PATH)
    if moved:
        log.warning("the training paths' record put %s on %s; their straight-through gates pass a gradient to every "
                    "head, which that path drops for the unselected ones, so they train on %s",
                    ", ".join(moved), KERNEL_PATH, REFERENCE_PATH)
    unknown = sorted(set(paths) - set(layers))
    if unknown:
        raise ValueError(f"the training paths name layers this model has no probed MoH layer for: {unknown}; "
                         f"its probed layers are {sorted(layers)} (was the record made for another model?)")
    small = dict(record.get("attention") or {})
    unknown = sorted(set(small) - set(attention))
    if unknown:
        raise ValueError(f"the training attention names layers this model has no softmax attention layer for: "
                         f"{unknown}; its layers are {sorted(attention)} (was the record made for another model?)")
    wrong = sorted(name for name, value in small.items() if value != SMALL_ATTENTION)
    if wrong:
        raise ValueError(f"the training attention of {wrong} is not {SMALL_ATTENTION!r}, the one option a record "
                         f"names (layers it does not name train on {SDPA})")
    for name, layer in layers.items():
        layer.train_path = paths.get(name, REFERENCE_PATH)
    for name, layer in attention.items():
        layer.train_attention = small.get(name, SDPA)


def describe(record: Mapping[str, Any]) -> str:
    """One line for the log: how many layers train on the kernels."""
    paths = record.get("paths") or {}
    on_kernel = sorted(name for name, path in paths.items() if path == KERNEL_PATH)
    small = sorted(record.get("attention") or {})
    if not on_kernel and not small:
        return f"every MoH layer on masked_dense, every attention on {SDPA} ({record.get('reason', '')})"
    parts = []
    if on_kernel:
        parts.append(f"{len(on_kernel)} MoH layer(s) on {KERNEL_PATH} ({', '.join(on_kernel)})")
    if small:
        parts.append(f"{len(small)} layer(s) attending on {SMALL_ATTENTION} ({', '.join(small)})")
    return "; ".join(parts) + f"; the others on masked_dense and {SDPA}"


def _capture_inputs(model: nn.Module, layers: Mapping[str, MoHAttention], forward: Callable[[], object]) -> dict:
    """Each layer's first input x: [B, N, C] in one ``forward()`` in training mode, without gradients;
    buffers (e.g. batch-norm statistics) and the CPU random state are restored after."""
    inputs: dict[str, torch.Tensor] = {}

    def hook(name):
        def grab(module, args):
            if name not in inputs and args and isinstance(args[0], torch.Tensor):
                inputs[name] = args[0].detach().clone()
        return grab

    handles = [layer.register_forward_pre_hook(hook(name)) for name, layer in layers.items()]
    try:
        with untouched(model, training=True), torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return inputs


def _options(layer: HeadAttention, x: torch.Tensor, probed: bool) -> dict[str, tuple[str, str]]:
    """The options ``layer`` can train on at input x: [B, N, C], as label -> (MoH training path, attention); the
    reference first (for a probed MoH layer ``masked_dense``, else ``sdpa``)."""
    reference = REFERENCE_PATH if probed else SDPA
    options = {reference: (REFERENCE_PATH, SDPA)}
    if layer.attends_by_sdpa:
        with torch.no_grad():
            q, k, v = layer.project_qkv(x[:1])
        if small_attention_fits(q, k, v, None, False, layer.attn_drop.p):
            options[SMALL_ATTENTION] = (REFERENCE_PATH, SMALL_ATTENTION)
    if probed and kernel_runs(layer, x, loops=True):
        options[KERNEL_PATH] = (KERNEL_PATH, SDPA)
    return options


def _layer_key(layer: HeadAttention, x: torch.Tensor, device: str, dtype: str) -> tuple:
    """What a layer's timing depends on (MoH: ``probe_key``; else the geometry and the input's shape)."""
    if isinstance(layer, MoHAttention):
        return layer.probe_key(x, device, dtype)
    geometry = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.proj.out_features)
    return (device, torch.get_num_threads(), torch.__version__, dtype, tuple(x.shape), geometry)


def _time_layer(layer: HeadAttention, x: torch.Tensor, options: Mapping[str, tuple[str, str]], timer,
                repeats: int, margin: float, give_up: float) -> tuple[str, dict[str, float]]:
    """(the option, best ms per option) for one layer's forward and backward on x: [B, N, C]; the layer's settings
    are restored after."""
    x = x.detach().requires_grad_(x.is_floating_point())
    params = [p for p in layer.parameters() if p.requires_grad]
    wrt = ([x] if x.requires_grad else []) + params
    grad_out = torch.randn(x.shape[:-1] + (layer.proj.out_features,), generator=torch.Generator().manual_seed(0))
    grad_out = grad_out.to(x.device)
    probed = isinstance(layer, MoHAttention)
    saved = (layer.train_path if probed else None, layer.train_attention)

    def step(path: str, attention: str) -> Callable[[], None]:
        def run() -> None:
            if probed:
                layer.train_path = path
            layer.train_attention = attention
            out = layer(x)
            loss = (out.float() * grad_out).sum()
            if layer.aux_loss is not None:  # the load-balancing loss trains the router too
                loss = loss + layer.aux_loss
            torch.autograd.grad(loss, wrt, allow_unused=True)
        return run

    reference = next(iter(options))
    try:
        runs = {label: step(*option) for label, option in options.items()}
        samples = time_paths(runs, timer, repeats, give_up, keep=reference)
    finally:
        if probed:
            layer.train_path = saved[0]
        layer.train_attention = saved[1]
    choice = pick_path(samples, reference, margin)
    return choice, {name: round(1e3 * min(s), 3) for name, s in samples.items()}
