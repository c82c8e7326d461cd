"""``python -m visattn.bench study``: the study's own models (conf/study/), whole, per cell, images/s.

Each task's model is built as a study run builds it: the profile's command line for the cell
(``visattn.study.plan_runs``) composed by Hydra into the entry point's config, and the model made by
that task's builder. Inference is eval without gradients; a training step is forward, the loss plus
MoH's load-balancing loss, backward and an AdamW step (the study's optimizer, fused where torch has
it). All cells of a task are timed round-robin in the same rounds (``measure.measure_cases``), so
the ratios to the first cell (``mha``) hold on a shared machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .attention import AttentionCase
from .measure import add_images_per_s, measure_cases
from .workload import Workload

STUDY_TASKS = ("cls", "dit")
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def study_config(task: str, cell: str, profile: str = "full") -> dict[str, Any]:
    """The resolved config of the profile's seed-0 run of ``cell`` for ``task`` (Hydra-composed)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from visattn.study import load_study_config, plan_runs

    if task not in STUDY_TASKS:
        raise ValueError(f"task {task!r} is not known; use one of {STUDY_TASKS}")
    study = load_study_config(profile)
    (spec,) = plan_runs(profile, Path("study-bench"), tasks=[task], cells=[cell], seeds=[0])
    overrides = [o for o in spec.overrides if not o.startswith("hydra.")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(study.tasks[task].config_name, overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def build_study_model(task: str, cfg: dict[str, Any]) -> nn.Module:
    """The model a study run of ``task`` trains from its resolved config ``cfg``."""
    from omegaconf import OmegaConf

    if task == "cls":
        from visattn.engine.cls.setup import build_cls_model

        return build_cls_model(OmegaConf.create(cfg))
    from visattn.engine.dit.setup import build_model

    return build_model(cfg)


def study_inputs(task: str, cfg: dict[str, Any], batch: int, model: nn.Module) -> tuple[torch.Tensor, ...]:
    """Random inputs of ``batch`` images for the task's model: images (cls), or noisy images,
    timesteps and labels (DiT)."""
    data = cfg["data"]
    if task == "cls":
        return (torch.randn(batch, data["in_chans"], data["image_size"], data["image_size"]),)
    x = torch.randn(batch, model.in_channels, model.input_size, model.input_size)
    steps = int(cfg["diffusion"]["timesteps"])
    return x, torch.randint(0, steps, (batch,)), torch.randint(0, int(data["num_classes"]), (batch,))


def set_moh_impl(model: nn.Module, impl: str) -> None:
    """Set ``impl`` on every MoH layer of ``model`` that can run it (``dense``, ``sparse`` and ``auto``
    always; a path name where the layer has it)."""
    from visattn.attention.moh import MoHAttention

    for layer in model.modules():
        if isinstance(layer, MoHAttention) and (impl in ("auto", "dense", "sparse") or impl in layer.paths):
            layer.impl = impl


def build_study_workload(
    task: str, cell: str, batch: int, profile: str = "full", seed: int = 0, probe_train_paths: bool = True,
    device: torch.device | str = "cpu",
) -> Workload:
    """The study model of ``cell`` for ``task`` with random inputs of ``batch`` images, the AdamW its
    trainer builds, and, where the profile sets ``train.attn_paths=probe`` (and ``probe_train_paths``),
    the MoH training paths its trainer would choose at start (in float32) on ``device``: on a GPU the
    masked dense path (the trainer's probe says so without timing), so nothing is probed there."""
    from visattn.attention import apply_train_paths, choose_train_paths
    from visattn.engine.optim import adamw, build_optimizer

    cfg = study_config(task, cell, profile)
    torch.manual_seed(seed)
    model = build_study_model(task, cfg)
    cpu = torch.device("cpu")
    if task == "cls":
        optimizer = build_optimizer(model, cfg["optim"], cpu)
    else:
        train = cfg["train"]
        optimizer = adamw(model.parameters(), cpu, lr=float(train["lr"]), weight_decay=float(train["weight_decay"]))
    work = Workload(model, study_inputs(task, cfg, batch, model), optimizer=optimizer)
    on_cpu = torch.device(device).type == "cpu"
    if probe_train_paths and on_cpu and cfg["train"].get("attn_paths", "dense") == "probe":
        apply_train_paths(model, choose_train_paths(model, work.loss))
    return work


def run_study_bench(
    tasks: list[str],
    cells: list[str],
    batch: int,
    dtypes: list[str],
    warmup: int = 1,
    repeats: int = 5,
    train: bool = True,
    memory: bool = False,
    clock: str = "wall",
    profile: str = "full",
    device: torch.device | str = "cpu",
    compare_kernels: bool = False,
    moh_impl: str | None = None,
) -> list[dict[str, Any]]:
    """Rows as ``measure_cases`` gives them plus ``preset`` (``study-<task>``), ``infer_images_per_s``,
    ``train_images_per_s``, ``paths`` (per attention layer, the path its inference took) and
    ``train_paths`` (the path it trained on), ``train_attention`` (per layer, SDPA or the small-heads kernel); the
    first cell of ``cells`` is the reference of the ratios. ``compare_kernels``: each cell also as
    ``<cell> pytorch``, the same model with ``visattn.kernels`` switched off, in the same rounds (the
    reference too: its small heads may run the kernels' attention, ``visattn.attention.small_heads``).
    ``moh_impl``: each other cell also as ``<cell> <moh_impl>``, every MoH layer that has that path set
    to it (in training too; ``impl=auto`` trains on what the start-up probe chose, ``train_paths``)."""
    from visattn.attention import impl_choices

    rows: list[dict[str, Any]] = []
    built: dict[tuple[str, str], Workload] = {}

    def build(task: str, cell: str, batch: int, profile: str, label: str) -> Workload:
        # only a cell's own row probes: a " pytorch" row trains with the kernels off, an impl row on its impl
        built[task, label] = build_study_workload(task, cell, batch, profile, probe_train_paths=label == cell,
                                                  device=device)
        built[task, label].use_kernels = not label.endswith(" pytorch")
        if moh_impl is not None and label.endswith(f" {moh_impl}"):
            set_moh_impl(built[task, label].module, moh_impl)
        return built[task, label]

    labels = [(c, c) for c in cells]
    if compare_kernels:
        labels += [(f"{c} pytorch", c) for c in cells]
    if moh_impl is not None:
        labels += [(f"{c} {moh_impl}", c) for c in cells[1:]]
    for task in tasks:
        cases = {label: (AttentionCase(label, cell), (task, cell, batch, profile, label)) for label, cell in labels}
        measured = measure_cases(cases, build, dtypes, warmup, repeats, train, memory, reference=cells[0], clock=clock,
                                 device=device)
        for row in measured:
            add_images_per_s(row, batch)
            work = built.get((task, row["label"]))
            if work is not None:  # the path each attention layer's inference took (impl=auto chooses)
                layers = impl_choices(work.module)["layers"]  # and trained on (train.attn_paths=probe chooses)
                row["paths"] = [layer["path"] for layer in layers]
                row["train_paths"] = [layer.get("train_path", "dense") for layer in layers]
                row["train_attention"] = [layer["train_attention"] for layer in layers]
            rows.append({"preset": f"study-{task}", **row})
    return rows
