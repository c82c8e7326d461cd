"""Run a study plan: launch each training run as a subprocess, ``jobs`` at a time, then report.

On a CPU machine, ``jobs`` runs of one thread each use the cores better than one run of ``jobs``
threads (small models lose more to thread hand-offs than they gain).

Runs whose directory already holds the results.json of a finished run are skipped, so an
interrupted study resumes where it stopped; a run whose results.json says ``completed: false``
(failed or preempted) is launched again and resumes from its last checkpoint (``resume=auto``;
``train.log`` is appended to). A failed or timed-out run is logged and the study goes on; the
report then covers the runs that finished.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from visattn.engine.results import write_json
from visattn.report.document import write_report
from visattn.report.runs import run_completed
from visattn.report.targets import Targets
from visattn.utils.machine import describe_machine

from .plan import REPO_ROOT, RunSpec, recipe_of

log = logging.getLogger(__name__)


@dataclass
class RunOutcome:
    spec: RunSpec
    status: str  # "done" | "skipped (results.json exists)" | "failed (exit N)" | "timed out"
    wall_time_s: float

    @property
    def failed(self) -> bool:
        return self.status != "done" and not self.status.startswith("skipped")


def run_one(spec: RunSpec, profile: str, timeout_s: float | None, python: str = sys.executable) -> RunOutcome:
    """Launch one run (its output to ``run_dir/train.log``); never raises for a failed run."""
    if run_completed(spec.run_dir):
        return RunOutcome(spec, "skipped (results.json exists)", 0.0)
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    cell_info = {"cell": spec.cell, "core": spec.core, "task": spec.task, "seed": spec.seed, "profile": profile,
                 "command": spec.command, "machine": describe_machine()}
    write_json(spec.run_dir / "cell.json", cell_info)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    with (spec.run_dir / "train.log").open("a") as logfile:  # a resumed run appends
        try:
            code = subprocess.run(spec.argv(python), cwd=REPO_ROOT, stdout=logfile, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            return RunOutcome(spec, "timed out", time.perf_counter() - start)
    wall = time.perf_counter() - start
    # Other processes on the machine skew measured throughput; the report shows this load.
    write_json(spec.run_dir / "cell.json", {**cell_info, "load_average": [load_before, os.getloadavg()[0]]})
    if code != 0:
        return RunOutcome(spec, f"failed (exit {code})", wall)
    if not (spec.run_dir / "results.json").is_file():
        return RunOutcome(spec, "failed (no results.json)", wall)
    if not run_completed(spec.run_dir):
        return RunOutcome(spec, "incomplete (results.json says completed: false)", wall)
    return RunOutcome(spec, "done", wall)


def check_run_dirs(specs: Sequence[RunSpec]) -> None:
    """Refuse to resume into run dirs that hold a run of another recipe: keeping such a run as
    "finished" would mix two studies in one report. Raises ValueError naming the dir and the fix.
    The run dir itself is not part of the recipe (``recipe_of``)."""
    for spec in specs:
        cell = spec.run_dir / "cell.json"
        if not cell.is_file():
            continue
        try:
            recorded = json.loads(cell.read_text()).get("command")
        except (OSError, ValueError) as err:
            raise ValueError(f"{cell} is unreadable ({err}); delete {spec.run_dir} to run it again") from None
        if recorded is not None and recipe_of(recorded, spec.run_dir_key) != recipe_of(spec.command, spec.run_dir_key):
            raise ValueError(
                f"{spec.run_dir} holds a run of another recipe:\n  recorded: {recorded}\n  planned:  {spec.command}\n"
                f"give this study another --out, or move that study's folder away"
            )


def run_study(specs: Sequence[RunSpec], out: Path, profile: str, description: str, command: str = "",
              timeout_s: float | None = None, python: str = sys.executable,
              jobs: int = 1, targets: Targets | None = None) -> tuple[Path | None, list[RunOutcome]]:
    """Run every spec (``jobs`` at a time, started in plan order), write ``out/study.json`` and
    ``out/REPORT.md``; returns the report (None when no run finished) and the outcomes in plan
    order. ``command`` is the study's own command line; ``targets`` the profile's (see ``write_report``)."""
    if jobs < 1:
        raise ValueError(f"jobs={jobs} must be >= 1")
    check_run_dirs(specs)
    out.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc)

    def launch(item: tuple[int, RunSpec]) -> RunOutcome:
        index, spec = item
        log.info("[%d/%d] %s %s seed %d: %s", index, len(specs), spec.task, spec.cell, spec.seed, spec.command)
        outcome = run_one(spec, profile, timeout_s, python)
        log.log(logging.ERROR if outcome.failed else logging.INFO, "[%d/%d] %s in %.0f s (log: %s)", index,
                len(specs), outcome.status, outcome.wall_time_s, spec.run_dir / "train.log")
        return outcome

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        outcomes = list(pool.map(launch, enumerate(specs, 1)))
    finished = dt.datetime.now(dt.timezone.utc)
    write_json(out / "study.json", {
        "profile": profile, "description": description, "machine": describe_machine(), "command": command,
        "started": started.isoformat(), "finished": finished.isoformat(),
        "wall_time_s": (finished - started).total_seconds(),
        "runs": [{"task": o.spec.task, "cell": o.spec.cell, "seed": o.spec.seed, "run_dir": str(o.spec.run_dir),
                  "status": o.status, "wall_time_s": o.wall_time_s, "command": o.spec.command} for o in outcomes],
    })
    failed = [o for o in outcomes if o.failed]
    finished_dirs = [o.spec.run_dir for o in outcomes if run_completed(o.spec.run_dir)]
    if not finished_dirs:
        log.error("no run finished; no report written (see the train.log files under %s)", out / "runs")
        return None, outcomes
    minutes = (finished - started).total_seconds() / 60
    skipped = sum(o.status.startswith("skipped") for o in outcomes)
    note = f"Profile `{profile}`: {description} Study wall time {minutes:.1f} min"
    note += f" (this invocation; it kept {skipped} run(s) finished earlier)." if skipped else "."
    if command:
        note += f" Command: `{command}`."
    if failed:
        note += " Runs that did not finish (absent from the tables): " + "; ".join(
            f"{o.spec.task}/{o.spec.cell}/seed{o.spec.seed} {o.status}" for o in failed) + "."
    report = write_report(finished_dirs, out, title=f"visattn benchmark study ({profile} profile)", note=note,
                          targets=targets)
    return report, outcomes


def report_progress(specs: Sequence[RunSpec], out: Path, profile: str, description: str,
                    command: str = "", targets: Targets | None = None) -> Path | None:
    """``out/REPORT.md`` over the planned runs finished so far, for a study run in sittings: the title
    and the note say how many of the plan's runs it covers and which cells lack seeds. None (and
    an error logged) when no run has finished."""
    done = [spec for spec in specs if run_completed(spec.run_dir)]
    if not done:
        log.error("none of the %d planned runs under %s has finished; no report written", len(specs), out / "runs")
        return None
    note = (f"Profile `{profile}`: {description} IN PROGRESS: {len(done)} of the {len(specs)} planned runs have "
            "finished; this report covers those only.")
    per_task: dict[str, list[int]] = {}
    for spec in specs:
        per_task.setdefault(spec.task, [0, 0])
        per_task[spec.task][0] += 1
        per_task[spec.task][1] += spec in done
    note += " Finished / planned: " + ", ".join(f"{task} {d}/{p}" for task, (p, d) in per_task.items()) + "."
    note += " The plan runs seed by seed; each table's seeds column says how many a cell has so far."
    if command:
        note += f" Continue with `{command.replace(' --report-only', '')}`."
    title = f"visattn benchmark study ({profile} profile, in progress: {len(done)} of {len(specs)} runs)"
    if len(done) == len(specs):
        title, note = f"visattn benchmark study ({profile} profile)", f"Profile `{profile}`: {description}"
    return write_report([spec.run_dir for spec in done], out, title=title, note=note, targets=targets)

