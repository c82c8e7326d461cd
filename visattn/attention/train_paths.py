"""The path each MoH layer trains on under ``impl="auto"``, chosen once per run by timing.

In eval ``auto`` probes per input shape (``impl_probe``). Training differs in two ways. Only two paths
compete: the masked dense one and ``routed_kernel_loops``, whose compiled backward made the study's
MoH-50 ViT train at 0.96-1.00x MHA's speed where the masked dense path ran at 0.93-0.96x
(docs/benchmarks.md); the PyTorch skipping paths train slower than the masked dense one. And a run must not change path
between its processes: two paths agree only to float rounding, so a resumed run (or another rank)
that chose differently would change the run's last bits. So a run chooses once, at start, on the
run's own batch shape: ``choose_train_paths`` times each layer's forward and backward on both paths
and returns a record; the trainer takes rank 0's, applies it (``apply_train_paths``), keeps it in
results.json and every checkpoint, and a resumed run applies the saved record instead of probing, as
``train.amp=auto`` does with its choice.

Record: ``{"paths": {layer name: path}, "times_ms": {layer name: {path: best ms}}, "device": ...,
"reason": ...}``; layers not named train on the masked dense path.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from visattn.utils.probing import untouched

from .impl_probe import default_timer, device_name, pick_path, time_paths
from .moh import PATHS, REFERENCE_PATH, TRAIN_PATHS, MoHAttention
from .routed_kernel import kernel_runs
from .sparse import compute_dtype

log = logging.getLogger(__name__)

KERNEL_PATH = TRAIN_PATHS[1]


def probed_layers(model: nn.Module) -> dict[str, MoHAttention]:
    """The MoH layers of ``model`` whose training path a probe chooses: ``impl="auto"`` and a kernel
    path to train on."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, MoHAttention) and m.impl == "auto" and KERNEL_PATH in m.paths}


def empty_record(reason: str) -> dict[str, Any]:
    """A record that leaves every layer on the masked dense path."""
    return {"paths": {}, "times_ms": {}, "device": device_name("cpu"), "reason": reason}


def choose_train_paths(
    model: nn.Module,
    forward: Callable[[], object],
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    timer: Callable[[str, Callable[[], object]], float] | None = None,
    repeats: int = 5,
    margin: float = 0.02,
    give_up: float = 3.0,
) -> dict[str, Any]:
    """The training path of every probed layer of ``model`` (``probed_layers``), as a record (see the
    module docstring).

    ``forward()`` runs the model on a batch of the run's shape (e.g. the amp probe's loss); it runs
    once, without gradients, in training mode, to capture each layer's input. Then each layer runs
    forward and backward (``torch.autograd.grad``: no ``.grad`` is touched) on that input through both
    paths, under ``autocast()`` (the run's mixed precision), timed as ``impl_probe`` times (``timer``,
    ``default_timer`` when None; ``repeats``, ``give_up``), and keeps the kernel path only if it beats
    the masked dense one by more than ``margin`` (``pick_path``). Layers of one signature and input shape
    share a measurement. Where the kernel does not run (bf16, a GPU, no toolchain) nothing is
    timed. The probe leaves no trace: the model's mode, buffers, gradients and torch's CPU random
    state are as before.
    """
    layers = probed_layers(model)
    if not layers:
        return empty_record("no MoH layer with impl=auto and a kernel path")
    param = next(model.parameters(), None)
    if param is not None and param.device.type != "cpu":
        return empty_record(f"the kernel runs on the CPU, the model is on {param.device.type}: masked dense")
    inputs = _capture_inputs(model, layers, forward)
    device = device_name(next(iter(inputs.values())).device) if inputs else device_name("cpu")
    record = {"paths": {}, "times_ms": {}, "device": device, "reason": "probe: forward and backward of each layer"}
    shared: dict[tuple, tuple[str, dict[str, float]]] = {}
    with untouched(model, training=True), autocast():
        for name, layer in layers.items():
            x = inputs.get(name)
            if x is None or not kernel_runs(layer, x, loops=True):
                continue
            dtype = str(compute_dtype(x)).removeprefix("torch.")
            key = layer.probe_key(x, device, dtype)
            if key not in shared:
                shared[key] = _time_layer(layer, x, timer or default_timer, repeats, margin, give_up)
            path, times = shared[key]
            record["paths"][name] = path
            record["times_ms"][name] = times
    if not record["paths"]:
        record["reason"] = "the kernel does not run here (dtype, device or toolchain): masked dense"
    return record


def apply_train_paths(model: nn.Module, record: Mapping[str, Any]) -> None:
    """Set every probed layer's ``train_path`` from ``record`` (layers it does not name: masked dense).
    A ValueError names a layer the model lacks or a path a layer cannot train on."""
    layers = probed_layers(model)
    paths = dict(record.get("paths") or {})
    unknown = sorted(set(paths) - set(layers))
    if unknown:
        raise ValueError(f"the training paths name layers this model has no probed MoH layer for: {unknown}; "
                         f"its probed layers are {sorted(layers)} (was the record made for another model?)")
    for name, layer in layers.items():
        layer.train_path = paths.get(name, REFERENCE_PATH)


def describe(record: Mapping[str, Any]) -> str:
    """One line for the log: how many layers train on the kernel."""
    paths = record.get("paths") or {}
    on_kernel = sorted(name for name, path in paths.items() if path == KERNEL_PATH)
    if not on_kernel:
        return f"every MoH layer on masked_dense ({record.get('reason', '')})"
    return f"{len(on_kernel)} MoH layer(s) on {KERNEL_PATH} ({', '.join(on_kernel)}), the others on masked_dense"


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


def _time_layer(layer: MoHAttention, x: torch.Tensor, timer, repeats: int, margin: float,
                give_up: float) -> tuple[str, dict[str, float]]:
    """(the path, best ms per path) for one layer's forward and backward on x: [B, N, C]."""
    x = x.detach().requires_grad_(x.is_floating_point())
    params = [p for p in layer.parameters() if p.requires_grad]
    wrt = ([x] if x.requires_grad else []) + params
    grad_out = torch.randn(x.shape[:-1] + (layer.proj.out_features,), generator=torch.Generator().manual_seed(0))
    grad_out = grad_out.to(x.device)

    def step(path: str) -> Callable[[], None]:
        def run() -> None:
            out = PATHS[path](layer, x)
            loss = (out.float() * grad_out).sum()
            if layer.aux_loss is not None:  # the load-balancing loss trains the router too
                loss = loss + layer.aux_loss
            torch.autograd.grad(loss, wrt, allow_unused=True)
        return run

    samples = time_paths({path: step(path) for path in TRAIN_PATHS}, timer, repeats, give_up, keep=REFERENCE_PATH)
    path = pick_path(samples, REFERENCE_PATH, margin)
    return path, {name: round(1e3 * min(s), 3) for name, s in samples.items()}
