"""``python -m visattn.study --profile quick|full --out DIR``: train every cell, then write DIR/REPORT.md.

``--dry-run`` prints the command lines without running them; ``--task`` / ``--cell`` / ``--seed``
run a subset (repeatable). Re-running the same command resumes: finished runs are skipped.
``--report-only`` writes DIR/REPORT.md over the runs finished so far (a study run in sittings),
saying how many of the planned runs it covers.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from omegaconf import OmegaConf

from visattn.report.targets import check_targets

from .plan import PROFILES, load_study_config, plan_runs, subset_dir
from .runner import report_progress, run_study
from .subset import write_fashion_mnist_subset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m visattn.study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, required=True,
                        help="quick: 1 seed, few steps (a smoke test, ~10 min on 2 cores); full: 5 seeds for the core "
                             "cells, 3 for the rest (see conf/study/full.yaml for its cost)")
    parser.add_argument("--out", required=True, type=Path, help="study folder: runs/, study.json, REPORT.md, plots")
    parser.add_argument("--task", action="append", help="only this task (cls or dit); repeatable")
    parser.add_argument("--cell", action="append", help="only this cell (a name in conf/study/cells.yaml); repeatable")
    parser.add_argument("--seed", action="append", type=int, help="only this seed; repeatable")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per run (default: the profile's); 1 on a machine shared with other jobs")
    parser.add_argument("--jobs", type=int, default=None,
                        help="runs at a time (default: the profile's jobs, else 1); e.g. 2 runs of 1 thread on 2 cores")
    parser.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: write REPORT.md over the planned runs finished so far")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    out = args.out.resolve()
    cfg = load_study_config(args.profile)
    extra = {}
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads={args.threads} must be >= 1")
        extra = {task: [f"{task_cfg['keys']['threads']}={args.threads}"] for task, task_cfg in cfg.tasks.items()}
    specs = plan_runs(args.profile, out, tasks=args.task, cells=args.cell, seeds=args.seed, extra_overrides=extra)
    targets = OmegaConf.to_container(cfg.targets) if cfg.get("targets") else None
    if targets:
        check_targets(targets)
    if args.dry_run:
        print("\n".join(spec.command for spec in specs))
        return 0
    command = shlex.join(["python", "-m", "visattn.study", *(sys.argv[1:] if argv is None else argv)])
    if args.report_only:
        report = report_progress(specs, out, args.profile, str(cfg.description), command=command, targets=targets)
        if report is not None:
            print(report)
        return 0 if report is not None else 1
    subset = subset_dir(cfg, out)
    if subset is not None:
        write_fashion_mnist_subset(subset, cfg.data_subset.train_per_class, cfg.data_subset.test_per_class)
    jobs = args.jobs if args.jobs is not None else int(cfg.get("jobs") or 1)
    if jobs < 1:
        parser.error(f"--jobs={jobs} must be >= 1")
    report, outcomes = run_study(specs, out, args.profile, str(cfg.description), command=command,
                                 timeout_s=cfg.get("timeout_s"), jobs=jobs, targets=targets)
    if report is not None:
        print(report)
    return 1 if report is None or any(o.failed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
