"""Read training run directories (the run-dir contract) and group them into cells.

A run directory holds ``results.json`` (required), ``metrics.csv``, for routed attention
``head_load.json`` and, for generation, a ``samples.png`` grid. The study driver also writes
``cell.json`` (``cell`` label, ``profile``, ``command``, ``machine``); runs without it are labelled
from their attention config, and their command line is rebuilt from Hydra's
``.hydra/overrides.yaml`` when present.

A cell is (task, variant, head budget); its runs are the seeds.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from visattn.utils.machine import machine_line

log = logging.getLogger(__name__)

ENTRY_POINTS = {"cls": "train_cls.py", "dit": "train_dit.py"}
REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_DIR_OVERRIDE = re.compile(r"hydra\.run\.dir=\S+")
# A generation run's grid of its first samples (written by visattn.engine.dit.sampling.save_samples).
SAMPLE_GRID = "samples.png"
# Results that depend on the machine's speed: comparable only between runs on one kind of machine.
TIMING_KEYS = ("train_images_per_s", "eval_images_per_s", "wall_time_s", "cpu_share")
# Attention kwargs that distinguish two variants with one registered name (ablations).
DISTINGUISHING_KWARGS = ("two_stage", "router", "gate", "num_kv_heads")
# Mixture-of-Head's routings by attention name: each token picks its heads, or each head its tokens.
ROUTING_KINDS = {"moh": "token_choice", "moh_head_choice": "head_choice"}


def _repo_relative(path: Path) -> str:
    return os.path.relpath(Path(path).resolve(), REPO_ROOT)


@dataclass
class Run:
    """One training run: its directory and what it wrote."""

    path: Path
    results: dict[str, Any]
    metrics: list[dict[str, float | None]] = field(default_factory=list)
    head_load: dict[str, Any] | None = None
    cell_info: dict[str, Any] = field(default_factory=dict)

    @property
    def task(self) -> str:
        return str(self.results.get("task", "?"))

    @property
    def variant(self) -> str:
        return self.cell_info.get("cell") or _variant_from_config(self.results)

    @property
    def core(self) -> bool:
        """A run of a study's core cell (cell.json; runs outside a study are not)."""
        return bool(self.cell_info.get("core"))

    @property
    def heads(self) -> tuple[int, int] | None:
        heads = self.results.get("active_heads")
        return (int(heads[0]), int(heads[1])) if heads else None

    @property
    def budget(self) -> str:
        heads = self.heads
        return f"{heads[0]}/{heads[1]}" if heads else "—"

    @property
    def seed(self) -> Any:
        return self.results.get("seed")

    @property
    def routing(self) -> tuple[str, str] | None:
        """(kind, set-up) of a Mixture-of-Head run: kind ``token_choice`` (attn=moh) or ``head_choice``
        (attn=moh_head_choice); the set-up names the per-layer budget and the router settings, so two
        runs routed alike but for the kind have equal set-ups. None for other attention."""
        config = self.results.get("config") or {}
        attn = config.get("attn") or {}
        kind = ROUTING_KINDS.get(attn.get("name"))
        if kind is None:
            return None
        budget = {k: v for k, v in (config.get("budget") or {}).items() if k != "name" and v is not None}
        setup = {**{k: v for k, v in attn.items() if k != "name"}, **budget}
        return kind, json.dumps(setup, sort_keys=True)

    @property
    def machine(self) -> str | None:
        """The line naming the machine the run ran on (cell.json), None when not recorded."""
        info = self.cell_info.get("machine")
        return machine_line(info) if info else None

    @property
    def command(self) -> str | None:
        if self.cell_info.get("command"):
            # Older runs recorded an absolute run dir: show it relative to the repository (the runs'
            # working directory), so a report holds no path of the machine that ran it.
            return RUN_DIR_OVERRIDE.sub(f"hydra.run.dir={_repo_relative(self.path)}", str(self.cell_info["command"]))
        overrides = self.path / ".hydra" / "overrides.yaml"
        if overrides.is_file():
            items = yaml.safe_load(overrides.read_text()) or []
            return " ".join(["python", ENTRY_POINTS.get(self.task, "<entry point>"), *map(str, items)])
        return None

    def value(self, key: str) -> float | None:
        """A numeric result, or None when the run did not measure it."""
        value = self.results.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value)


@dataclass
class Cell:
    """The seeds of one (task, variant, budget)."""

    task: str
    variant: str
    budget: str
    runs: list[Run]

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.task, self.variant, self.budget)

    @property
    def heads(self) -> tuple[int, int] | None:
        return self.runs[0].heads

    @property
    def core(self) -> bool:
        return bool(self.runs) and all(run.core for run in self.runs)

    @property
    def label(self) -> str:
        """The variant, with its head budget when it is not the study's own cell name."""
        if self.runs and self.runs[0].cell_info.get("cell"):
            return self.variant
        return f"{self.variant} ({self.budget} heads)"

    @property
    def routed(self) -> bool:
        return any(run.head_load for run in self.runs)

    @property
    def routing(self) -> tuple[str, str] | None:
        return self.runs[0].routing if self.runs else None

    def values(self, key: str) -> list[float]:
        return [v for v in (run.value(key) for run in self.runs) if v is not None]

    def text(self, key: str) -> str | None:
        """A string result shared by every seed (e.g. the FID extractor); joined when they differ."""
        found = sorted({str(run.results[key]) for run in self.runs if run.results.get(key) is not None})
        return ", ".join(found) if found else None


def _variant_from_config(results: dict[str, Any]) -> str:
    name = str(results.get("attn", "?"))
    attn_cfg = (results.get("config") or {}).get("attn") or {}
    extras = [f"{k}={attn_cfg[k]}" for k in DISTINGUISHING_KWARGS if attn_cfg.get(k) is not None]
    return f"{name}[{','.join(extras)}]" if extras else name


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def read_metrics_csv(path: Path) -> list[dict[str, float | None]]:
    """Rows of ``metrics.csv`` with every value parsed as a float (None where empty or not numeric)."""
    with path.open(newline="") as handle:
        return [{key: _number(value) for key, value in row.items() if key} for row in csv.DictReader(handle)]


def load_run(path: str | Path) -> Run:
    """Load one run directory; FileNotFoundError when it has no results.json."""
    path = Path(path)
    results_file = path / "results.json"
    if not results_file.is_file():
        raise FileNotFoundError(f"{results_file} does not exist: pass run directories that hold a results.json")
    try:
        results = json.loads(results_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{results_file} is not valid JSON ({err}); re-run or remove that run directory") from err
    metrics_file, head_load_file, cell_file = path / "metrics.csv", path / "head_load.json", path / "cell.json"
    return Run(
        path=path,
        results=results,
        metrics=read_metrics_csv(metrics_file) if metrics_file.is_file() else [],
        head_load=json.loads(head_load_file.read_text()) if head_load_file.is_file() else None,
        cell_info=json.loads(cell_file.read_text()) if cell_file.is_file() else {},
    )


def run_completed(path: str | Path) -> bool:
    """Whether the run directory's results.json records a finished run. A failed or preempted run
    writes ``completed: false``; results without the key (eval runs, older engines) count as
    finished, and so does an unreadable file (``load_run`` then says what is wrong with it)."""
    results_file = Path(path) / "results.json"
    if not results_file.is_file():
        return False
    try:
        results = json.loads(results_file.read_text())
    except json.JSONDecodeError:
        return True
    return not (isinstance(results, dict) and results.get("completed") is False)


UNSCORED_MODES = ("sample", "cache_latents")  # DiT runs that write samples or latents, no scores


def _mode(path: Path) -> str | None:
    try:
        results = json.loads((path / "results.json").read_text())
    except (OSError, ValueError):
        return None  # load_run says what is wrong with the file
    return results.get("mode") if isinstance(results, dict) else None


def find_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Every directory at or below ``paths`` that holds the results.json of a finished run, sorted,
    without duplicates. Runs whose results.json says ``completed: false`` (failed or preempted; they
    lack the final metrics) are left out and logged."""
    found: set[Path] = set()
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist: pass run directories (or folders holding them)")
        if (path / "results.json").is_file():
            found.add(path.resolve())
        elif path.is_dir():
            found.update(p.parent.resolve() for p in path.rglob("results.json"))
    unfinished = sorted(path for path in found if not run_completed(path))
    for path in unfinished:
        log.warning("leaving out %s: its results.json says completed: false (failed or preempted; "
                    "re-run it to resume)", path)
    unscored = sorted(path for path in found - set(unfinished) if _mode(path) in UNSCORED_MODES)
    for path in unscored:
        log.info("leaving out %s: a mode=%s run measures nothing to compare", path, _mode(path))
    found.difference_update(unfinished, unscored)
    if not found:
        raise FileNotFoundError(f"no results.json of a finished run under {[str(p) for p in paths]}: "
                                "no finished runs to report")
    return sorted(found)


def group_cells(runs: Iterable[Run]) -> list[Cell]:
    """Group runs into cells, ordered by task, then by first appearance (the study's cell order)."""
    cells: dict[tuple[str, str, str], Cell] = {}
    for run in runs:
        key = (run.task, run.variant, run.budget)
        cells.setdefault(key, Cell(*key, runs=[])).runs.append(run)
    return sorted(cells.values(), key=lambda cell: cell.task)


def timing_machine(runs: Iterable[Run]) -> str | None:
    """The machine that ran the most of ``runs`` (ties: the first by name); None when none is recorded."""
    counts = Counter(run.machine for run in runs if run.machine)
    return min(counts, key=lambda machine: (-counts[machine], machine)) if counts else None


def timings_from(cells: Iterable[Cell], machine: str | None) -> list[Cell]:
    """The cells with their timing results (``TIMING_KEYS``) kept only for runs on ``machine``.

    A study run in several sittings may land on different CPUs (an AVX2 and an AVX-512 machine differ
    by ~1.5x here); a mean over both would rank cells by where their seeds happened to run. Quality,
    parameters, FLOPs and memory do not depend on the CPU's speed and keep every run."""
    if machine is None:
        return list(cells)
    kept = []
    for cell in cells:
        runs = [run if run.machine == machine else
                replace(run, results={k: v for k, v in run.results.items() if k not in TIMING_KEYS})
                for run in cell.runs]
        kept.append(replace(cell, runs=runs))
    return kept


def reference_cell(cells: Iterable[Cell], task: str) -> Cell | None:
    """The task's MHA baseline: the ``mha`` cell with the most heads (plain MHA at full width)."""
    candidates = [c for c in cells if c.task == task and c.variant == "mha" and c.heads]
    return max(candidates, key=lambda c: c.heads[1], default=None)
