"""The study plan: which runs to launch, with which command lines, into which run directories.

Reads ``conf/study/cells.yaml`` (attention variants and head budgets), ``conf/study/tasks.yaml``
(per task: entry point, experiment, override keys) and ``conf/study/<profile>.yaml`` (seeds and
the steps of that profile), and expands them into one ``RunSpec`` per (task, cell, seed).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[2]
STUDY_CONF = REPO_ROOT / "conf" / "study"
PROFILES = ("quick", "full")


@dataclass(frozen=True)
class RunSpec:
    """One training run of the study: ``entry overrides...`` writing into ``run_dir``."""

    task: str
    cell: str
    seed: int
    run_dir: Path
    entry: str
    overrides: tuple[str, ...]
    core: bool = False  # a core cell (conf/study/cells.yaml): the report checks their ranking
    run_dir_key: str = "hydra.run.dir"  # the override that names run_dir (conf/study/tasks.yaml)

    def argv(self, python: str) -> list[str]:
        return [python, str(REPO_ROOT / self.entry), *self.overrides]

    @property
    def command(self) -> str:
        """The command line as a user would type it from the repository root."""
        return shlex.join(["python", self.entry, *self.overrides])


def recipe_of(command: str, run_dir_key: str) -> list[str]:
    """A run's command line without its run dir (the ``run_dir_key`` override): what the run
    computes. Commands that differ only in the folder are one recipe, so a study folder that was
    moved or renamed stays resumable."""
    return [arg for arg in shlex.split(command) if override_key(arg) != run_dir_key]


def format_override(key: str, value: Any) -> str:
    """``key=value`` in Hydra's override grammar (lists as ``[a,b]``, booleans lower case)."""
    return f"{key}={_hydra_value(value)}"


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return str(value)


def override_key(override: str) -> str:
    """``++attn.head_dim=12`` -> ``attn.head_dim``."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(overrides: Sequence[str]) -> tuple[str, ...]:
    """Later overrides of a key replace earlier ones (in the earlier one's place)."""
    merged: dict[str, str] = {}
    for override in overrides:
        key = override_key(override)
        merged[key] = override
    return tuple(merged.values())


def load_study_config(profile: str, conf_dir: Path = STUDY_CONF) -> DictConfig:
    """cells + tasks + the profile, merged; ValueError for an unknown profile."""
    if profile not in PROFILES:
        raise ValueError(f"profile={profile!r} is not known; use one of {PROFILES}")
    parts = [OmegaConf.load(conf_dir / name) for name in ("cells.yaml", "tasks.yaml", f"{profile}.yaml")]
    return OmegaConf.merge(*parts)


BUDGET_KEYS = ("num_heads", "shared_heads", "routed_topk")


def _cell_overrides(cell: Mapping[str, Any], task_cfg: Mapping[str, Any]) -> list[str]:
    """The cell's attention, per-layer budget and attention kwargs as the task's overrides."""
    keys = task_cfg["keys"]
    overrides = [format_override(keys["attn"], cell["attn"])]
    for name in BUDGET_KEYS:
        if cell.get(name) is not None:
            overrides.append(format_override(keys[name], list(cell[name])))
    if cell.get("num_heads") is not None:
        # Fewer heads per layer, each as wide as the study model's heads (not dim / heads).
        overrides.append(format_override(keys["head_dim"], task_cfg["head_dim"]))
    for name, value in (cell.get("attn_kwargs") or {}).items():
        overrides.append(format_override(f"{keys['attn_kwargs']}.{name}", value))
    return overrides


def repo_relative(path: Path) -> str:
    """``path`` relative to the repository root (the runs' working directory), so command lines and
    the report hold no absolute paths of the machine that ran them."""
    return os.path.relpath(Path(path).resolve(), REPO_ROOT)


def cell_seeds(cfg: Mapping[str, Any], cell: Mapping[str, Any]) -> list[int]:
    """The profile's ``core_seeds`` for a cell marked ``core: true`` (when the profile has them), else ``seeds``."""
    if cell.get("core") and cfg.get("core_seeds") is not None:
        return list(cfg["core_seeds"])
    return list(cfg["seeds"])


def subset_dir(cfg: Mapping[str, Any], out: Path) -> Path | None:
    """Where the profile's class-balanced Fashion-MNIST subset lives; None = the full dataset."""
    subset = cfg.get("data_subset")
    if not subset:
        return None
    return out / "data" / f"fashion-mnist-{subset['train_per_class']}-{subset['test_per_class']}-per-class"


def plan_runs(
    profile: str,
    out: Path,
    tasks: Sequence[str] | None = None,
    cells: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    extra_overrides: Mapping[str, Sequence[str]] | None = None,
    conf_dir: Path = STUDY_CONF,
) -> list[RunSpec]:
    """Every run of the profile, in study order: seed by seed, and within a seed per task, per cell
    (``core_seeds`` for the cells marked ``core``), so a study stopped part-way (it runs in
    sittings) has every cell at the same number of seeds. Paths in the overrides are relative to the
    repository root.

    ``tasks`` / ``cells`` / ``seeds`` select a subset (ValueError naming unknown ones);
    ``extra_overrides`` appends task-specific overrides (e.g. fewer steps in a test).
    """
    cfg = OmegaConf.to_container(load_study_config(profile, conf_dir), resolve=True)
    known_tasks, known_cells = list(cfg["tasks"]), [c["name"] for c in cfg["cells"]]
    for kind, chosen, known in (("task", tasks, known_tasks), ("cell", cells, known_cells)):
        unknown = sorted(set(chosen or ()) - set(known))
        if unknown:
            raise ValueError(f"unknown {kind}(s) {unknown}; choose from {known}")
    data_root = subset_dir(cfg, out)
    specs = []
    for task in tasks or known_tasks:
        task_cfg = cfg["tasks"][task]
        keys = task_cfg["keys"]
        recipe = [format_override(keys["experiment"], task_cfg["experiment"])]
        recipe += [format_override(k, v) for k, v in (task_cfg.get("overrides") or {}).items()]
        if data_root is not None:
            recipe.append(format_override(keys["data_root"], repo_relative(data_root)))
        for index, cell in enumerate(cfg["cells"]):
            if cells and cell["name"] not in cells:
                continue
            for seed in seeds if seeds is not None else cell_seeds(cfg, cell):
                run_dir = out / "runs" / task / f"{index:02d}_{cell['name']}" / f"seed{seed}"
                # The run seed also seeds sampling (noise and labels), so the seeds' spread holds the
                # sampling noise and a paired comparison shares it between cells.
                sample_seed = [format_override(keys["sample_seed"], seed)] if keys.get("sample_seed") else []
                overrides = [
                    *recipe,
                    *_cell_overrides(cell, task_cfg),
                    format_override(keys["seed"], seed),
                    *sample_seed,
                    format_override(keys["run_dir"], repo_relative(run_dir)),
                    *(extra_overrides or {}).get(task, ()),
                ]
                specs.append(RunSpec(task, cell["name"], int(seed), run_dir, task_cfg["entry"], merge_overrides(overrides),
                                     core=bool(cell.get("core")), run_dir_key=keys["run_dir"]))
    return sorted(specs, key=lambda spec: spec.seed)  # stable: task and cell order kept within a seed
