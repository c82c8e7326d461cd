"""Assemble REPORT.md (tables, plots, header with date, machine and commands) from run directories."""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from visattn.utils.machine import describe_machine, machine_line

from . import plots
from .convergence import ranking_check, ranking_sentence
from .metrics import INFERENCE_THROUGHPUT, TASK_TITLES, headline_metric
from .runs import (
    SAMPLE_GRID,
    Cell,
    Run,
    find_run_dirs,
    group_cells,
    load_run,
    reference_cell,
    timing_machine,
    timings_from,
)
from .stats import CONFIDENCE
from .tables import (
    comparison_table,
    cost_table,
    markdown_table,
    noise_statement,
    quality_table,
    routing_kind_table,
    same_budget_table,
)
from .targets import Targets, target_table

log = logging.getLogger(__name__)

SMOKE_PROFILES = {"quick"}


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "x"


def _run_machines(runs: Sequence[Run]) -> list[str]:
    """One line per machine that ran some of ``runs``, with how many runs of each task it ran."""
    counts: dict[str, Counter[str]] = {}
    for run in runs:
        if run.cell_info.get("machine"):
            counts.setdefault(machine_line(run.cell_info["machine"]), Counter())[run.task] += 1
    return [f"{line}: {sum(tasks.values())} runs ({', '.join(f'{task} {n}' for task, n in sorted(tasks.items()))})"
            for line, tasks in sorted(counts.items())]


def _header(runs: Sequence[Run], cells: Sequence[Cell], title: str, note: str | None) -> list[str]:
    profiles = sorted({str(r.cell_info["profile"]) for r in runs if r.cell_info.get("profile")})
    lines = [f"# {title}", ""]
    if SMOKE_PROFILES & set(profiles):
        lines += [
            "> **SMOKE TEST** (profile `quick`): one seed and a few steps per cell, to check the pipeline "
            "end to end. These numbers are not results; no interval exists with one seed, so nothing is ranked.",
            "",
        ]
    if note:
        lines += [f"> {note}", ""]
    lines.append(f"- Generated: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}")
    lines += [f"- Runs' machine: {m}" for m in _run_machines(runs)]
    lines.append(f"- Report machine: {machine_line(describe_machine())}")
    loads = [value for r in runs for value in r.cell_info.get("load_average") or []]
    if loads:
        lines.append(
            f"- 1-minute load average at the start and end of the runs: {min(loads):.1f} to {max(loads):.1f} "
            "(throughput and wall times are only comparable between runs made at similar load)"
        )
    walls = [wall for wall in (r.value("wall_time_s") for r in runs) if wall is not None]
    if walls:
        total = sum(walls)
        unknown = len(runs) - len(walls)
        lines.append(
            f"- Runs' wall time, summed: {total / 3600:.2f} h ({total / 60:.1f} min) over {len(walls)} runs "
            "(each run's own clock over all of its processes, from set-up to results; interpreter start-up "
            "not included)"
            + (f"; {unknown} run(s) without it (resumed from a checkpoint that kept no clock)" if unknown else "")
        )
    if profiles:
        lines.append(f"- Study profile(s): {', '.join(profiles)}")
    lines.append(f"- {len(runs)} runs in {len(cells)} cells (task × attention variant × head budget; runs = seeds)")
    lines += [
        f"- Statistics: quality is mean ± sample std over seeds, then the {CONFIDENCE:.0%} Student-t interval "
        "in brackets. Comparisons are paired by seed (a seed fixes the data order, the initial weights of "
        "equal architectures and the sampling noise): each entry is the mean per-seed difference (candidate − "
        f"reference) with its {CONFIDENCE:.0%} paired t-interval. Every comparison table is one family of "
        f"tests (all its cells × metrics), corrected with Holm's step-down method at family-wise α = "
        f"{1 - CONFIDENCE:.2f}; better / worse only where the corrected test rejects, otherwise within noise "
        "(not ranked).",
        "- Cost: executed FLOPs count the code path that ran (for several MoH settings the dense one); "
        "active-head FLOPs are the dense forward minus the inactive heads' query-side work (q projection, "
        "scores, weighted values, output projection), the budget a head-skipping kernel could reach.",
        "- sFID is reported only where both the samples and the reference hold at least 10 images per "
        "spatial feature dimension; otherwise its column gives the reason.",
        "- Throughput and peak memory were measured by each run on its machine; ratios are of the means "
        "over seeds to the same task's MHA. Throughput and wall time come only from the runs on the "
        "machine that ran most of the task (named under each cost table). A dash (—) means the runs did "
        "not measure it.",
        "",
    ]
    return lines


def _timing_note(cells: Sequence[Cell], machine: str | None) -> str | None:
    runs = [run for cell in cells for run in cell.runs]
    if machine is None:
        return None
    elsewhere = sum(run.machine != machine for run in runs)
    note = f"Throughput and wall time: the {len(runs) - elsewhere} runs on {machine}"
    if elsewhere:
        note += (f"; the other {elsewhere} run(s) ran on other machines and are left out of those columns "
                 "and of the throughput plot (CPUs differ in speed), not out of quality, FLOPs or memory")
    return note + "."


def _task_section(task: str, cells: list[Cell], out: Path, targets: Mapping[str, float] | None = None) -> list[str]:
    machine = timing_machine(run for cell in cells for run in cell.runs)
    timing_note = _timing_note(cells, machine)
    cells = timings_from(cells, machine)
    reference = reference_cell(cells, task)
    lines = [f"## {TASK_TITLES.get(task, task)}", ""]
    if reference is None:
        lines += ["No `mha` cell for this task: ratios and comparisons with MHA are absent.", ""]
    lines += ["### Quality", "", quality_table(cells, reference), ""]
    if targets and reference is not None:
        lines += ["### The recipe's targets (MHA)", "",
                  "What the study's recipe was chosen to reach with MHA (the profile's `targets`); the "
                  "comparisons below are about samples of this quality.", "",
                  target_table(reference, targets), ""]
    lines += ["### Compared with MHA (same task)", "", noise_statement(cells, reference), "",
              comparison_table(cells, reference), ""]
    same_budget = same_budget_table(cells, reference)
    if same_budget:
        lines += ["### Routing against fewer heads (same active heads per token)", "",
                  "Each routed cell against each cell without routing that uses as many heads per token "
                  "(a narrower plain MHA): does choosing heads per token beat simply having fewer heads? "
                  "Paired by seed, Holm-corrected over this table.", "",
                  same_budget, ""]
    by_kind = routing_kind_table(cells)
    if by_kind:
        lines += ["### Head choice against token choice (same budget)", "",
                  "Each head-choice cell (every routed head takes a fixed share of the image's tokens) "
                  "against the token-choice MoH cell with the same per-layer budget and router: is the "
                  "quality the same? Paired by seed, Holm-corrected over this table. Their speed is "
                  "compared by `python -m visattn.bench` on one machine (docs/results/benchmarks.md), "
                  "not by these runs' clocks.", "",
                  by_kind, ""]
    lines += ["### Cost", "", cost_table(cells, reference), ""]
    if timing_note:
        lines += [timing_note, ""]
    if task in INFERENCE_THROUGHPUT:
        lines += [f"Inference throughput here is the {INFERENCE_THROUGHPUT[task]}.", ""]
    metric = headline_metric(task)
    key = metric.key if metric else "quality"
    figures = [
        ("active heads", plots.quality_vs_heads(cells, reference, out / f"{task}_{key}_vs_active_heads.png")),
        ("throughput", plots.quality_vs_throughput(cells, out / f"{task}_{key}_vs_throughput.png", machine)),
        ("training curves", plots.training_curves(cells, out / f"{task}_training_curves.png")),
    ]
    lines += ["### Plots", ""]
    for name, path in figures:
        if path:
            lines += [f"![{TASK_TITLES.get(task, task)}: {name}]({path.name})", ""]
    if not any(path for _, path in figures):
        lines += ["— (nothing to plot)", ""]
    if task == "cls":  # trained long enough to rank? (the eval top-1 panel of the training curves)
        check = ranking_check(cells, "epoch", "top1")
        for paragraph in ranking_sentence(check, "epoch", "eval top-1", scale=100.0, unit=" pp").splitlines():
            lines += [paragraph, ""]
    routed = [cell for cell in cells if cell.routed]
    if routed:
        lines += ["### Head load per class (routed variants; cf. MoH Figure 3)", ""]
        for cell in routed:
            name = f"{task}_head_load_{_slug(cell.variant)}_{_slug(cell.budget)}.png"
            path = plots.head_load_heatmaps(cell, out / name)
            if path:
                lines += [f"![{cell.variant} head load]({path.name})", ""]
    return lines + _sample_grids(cells, out)


def _sample_grids(cells: Sequence[Cell], out: Path, per_row: int = 4) -> list[str]:
    """Each cell's first-seed sample grid, linked (not copied) from its run directory, so a reader
    sees what the scores measure."""
    grids = [(cell, cell.runs[0].path / SAMPLE_GRID) for cell in cells if (cell.runs[0].path / SAMPLE_GRID).is_file()]
    if not grids:
        return []
    lines = [f"### Samples (seed {grids[0][0].runs[0].seed} of each cell)", ""]
    for start in range(0, len(grids), per_row):
        row = grids[start:start + per_row]
        lines.append(markdown_table(
            [cell.variant for cell, _ in row],
            [[f"![{cell.variant} samples]({Path(os.path.relpath(path, out)).as_posix()})" for cell, path in row]]))
        lines.append("")
    return lines


def _commands(runs: Sequence[Run]) -> list[str]:
    lines = ["## Commands", "", "<details><summary>Command line of every run</summary>", "", "```"]
    for run in runs:
        lines.append(run.command or f"# {run.path.name}: command not recorded")
    lines += ["```", "", "</details>", ""]
    return lines


def write_report(paths: Iterable[str | Path], out: str | Path, title: str = "visattn benchmark report",
                 note: str | None = None, targets: Targets | None = None) -> Path:
    """Read every run under ``paths`` and write ``out/REPORT.md`` with its PNG plots; returns the file.
    ``targets`` (``{task: {metric: value}}``) adds a check of each task's MHA cell against them."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [load_run(path) for path in find_run_dirs(paths)]
    cells = group_cells(runs)
    log.info("report: %d runs in %d cells -> %s", len(runs), len(cells), out)
    lines = _header(runs, cells, title, note)
    for task in dict.fromkeys(cell.task for cell in cells):
        lines += _task_section(task, [cell for cell in cells if cell.task == task], out, (targets or {}).get(task))
    lines += _commands(runs)
    report = out / "REPORT.md"
    report.write_text("\n".join(lines))
    return report
