"""The study driver: its plan and budgets, every quick cell's config composes, and a first run runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from visattn.data.sets.fashion_mnist import fashion_mnist_available
from visattn.study import format_override, load_study_config, plan_runs, run_study
from visattn.study.plan import REPO_ROOT, merge_overrides
from visattn.study.subset import balanced_indices, write_fashion_mnist_subset

CONF = REPO_ROOT / "conf"
HEADS_PER_LAYER, DEPTH = 8, 6
needs_fashion_mnist = pytest.mark.skipif(not fashion_mnist_available(), reason="Fashion-MNIST is not installed")


def _cells() -> dict[str, dict]:
    cfg = OmegaConf.to_container(load_study_config("quick"))
    return {cell["name"]: cell for cell in cfg["cells"]}


def _without_hydra(overrides) -> list[str]:
    return [o for o in overrides if not o.startswith("hydra.")]


def test_override_grammar() -> None:
    assert format_override("budget.shared_heads", [3, 3, 4]) == "budget.shared_heads=[3,3,4]"
    assert format_override("attn.two_stage", False) == "attn.two_stage=false"
    assert format_override("x", None) == "x=null"
    # A later override of a key replaces the earlier one, in its place (Hydra would apply both).
    assert merge_overrides(["data.root=/a", "seed=0", "++data.root=/b"]) == ("++data.root=/b", "seed=0")


def test_head_budgets_follow_the_shallow_few_deep_many_rule() -> None:
    cells = _cells()
    total = HEADS_PER_LAYER * DEPTH
    for name, ratio in (("moh-50", 0.50), ("moh-75", 0.75), ("moh-90", 0.90)):
        active = [s + k for s, k in zip(cells[name]["shared_heads"], cells[name]["routed_topk"], strict=True)]
        assert len(active) == DEPTH and active == sorted(active), name  # never fewer heads deeper
        assert abs(sum(active) / total - ratio) < 1 / total, name
    for ablation in ("moh-75-no-shared", "moh-75-one-stage"):
        cell = cells[ablation]
        assert sum(s + k for s, k in zip(cell["shared_heads"], cell["routed_topk"], strict=True)) == 36
    assert cells["moh-75-no-shared"]["shared_heads"] == [0] * DEPTH
    assert cells["moh-dense-soft"]["routed_topk"] == [0] * DEPTH
    # Plain MHA with fewer heads gets exactly the routed cells' budgets.
    assert sum(cells["mha-fewer-heads-75"]["num_heads"]) == 36 and sum(cells["mha-fewer-heads-50"]["num_heads"]) == 24


def test_profiles_plan_every_cell_and_enough_seeds(tmp_path: Path) -> None:
    quick, full = plan_runs("quick", tmp_path), plan_runs("full", tmp_path)
    cells, tasks = _cells(), load_study_config("quick").tasks
    assert {(s.task, s.cell) for s in quick} == {(t, c) for t in tasks for c in cells}
    assert {s.seed for s in quick} == {0}
    assert all(len({s.seed for s in full if (s.task, s.cell) == key}) >= 3 for key in {(s.task, s.cell) for s in full})
    assert len({s.run_dir for s in full}) == len(full)  # no two runs share a directory
    core = {"mha", "moh-50", "moh-75", "moh-90", "mha-fewer-heads-50", "mha-fewer-heads-75"}
    for task in tasks:
        seeds = {c: {s.seed for s in full if (s.task, s.cell) == (task, c)} for c in cells}
        assert all(len(seeds[c]) >= 5 for c in core) and all(len(seeds[c]) == 3 for c in set(cells) - core)
    assert {s.cell for s in full if s.core} == core  # the report checks the core cells' ranking
    dit = [s for s in full if s.task == "dit"]
    assert all(f"sample.seed={s.seed}" in s.overrides for s in dit)  # each run samples with its own seed
    assert all("eval.num_samples=5000" in s.overrides for s in dit)
    # command lines hold paths relative to the repository, never this machine's absolute paths
    assert not any(o.split("=", 1)[1].startswith("/") for s in full for o in s.overrides)
    assert not any(str(REPO_ROOT) in s.command for s in full)
    assert all(s.run_dir.is_absolute() for s in full)
    with pytest.raises(ValueError, match="unknown cell"):
        plan_runs("quick", tmp_path, cells=["nope"])
    with pytest.raises(ValueError, match="profile='huge'"):
        plan_runs("huge", tmp_path)


def test_balanced_subset_indices() -> None:
    labels = np.array([0, 1, 0, 2, 1, 0, 2, 2, 1])
    assert balanced_indices(labels, 2).tolist() == [0, 1, 2, 3, 4, 6]
    with pytest.raises(ValueError, match="fewer than per_class=4"):
        balanced_indices(labels, 4)


def _expected_heads(cell: dict) -> tuple[int, int]:
    if cell.get("num_heads"):
        return sum(cell["num_heads"]), sum(cell["num_heads"])
    if cell.get("shared_heads"):
        return sum(s + k for s, k in zip(cell["shared_heads"], cell["routed_topk"], strict=True)), 48
    return 48, 48


def _build_on_meta(task: str, cfg):
    """The task's own model builder on the meta device (config validation for cls included)."""
    import torch

    with torch.device("meta"):
        if task == "cls":
            from visattn.engine.cls.setup import validate_cls_config

            return validate_cls_config(cfg)
        from visattn.engine.dit.setup import build_model

        return build_model(OmegaConf.to_container(cfg, resolve=True))


@pytest.mark.parametrize("task", ["cls", "dit"])
def test_every_quick_cell_composes_and_builds_its_budget(task: str, tmp_path: Path) -> None:
    from visattn import active_heads

    cells = _cells()
    specs = plan_runs("quick", tmp_path, tasks=[task])
    (tmp_path / "data" / "fashion-mnist-500-100-per-class").mkdir(parents=True)  # validated as a folder only
    config_name = load_study_config("quick").tasks[task].config_name
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for spec in specs:
            cfg = compose(config_name, overrides=_without_hydra(spec.overrides))
            assert cfg.data.name == "fashion_mnist" and cfg.seed == spec.seed
            model = _build_on_meta(task, cfg)
            assert active_heads(model) == _expected_heads(cells[spec.cell]), spec.cell


@needs_fashion_mnist
def test_quick_study_first_run_writes_results_and_report(tmp_path: Path) -> None:
    """One routed cell of the quick profile, shrunk to a few steps, through the real entry point."""
    data = write_fashion_mnist_subset(tmp_path / "fm", train_per_class=3, test_per_class=2)
    shrink = [f"data.root={data}", "train.batch_size=10", "train.eval_batch_size=20"]
    specs = plan_runs("quick", tmp_path / "study", tasks=["cls"], cells=["moh-75"], extra_overrides={"cls": shrink})
    assert len(specs) == 1 and f"data.root={data}" in specs[0].overrides
    report, outcomes = run_study(specs, tmp_path / "study", "quick", "test run", timeout_s=300)
    assert [o.status for o in outcomes] == ["done"], (specs[0].run_dir / "train.log").read_text()[-2000:]
    results = json.loads((specs[0].run_dir / "results.json").read_text())
    assert results["active_heads"] == [36, 48] and results["train_steps"] == 3
    cell_info = json.loads((specs[0].run_dir / "cell.json").read_text())
    assert cell_info["cell"] == "moh-75" and cell_info["core"] is True
    text = report.read_text()
    assert "SMOKE TEST" in text and "| moh-75 |" in text
    assert (tmp_path / "study" / "cls_head_load_moh-75_36-48.png").is_file()
    # Re-running resumes: the finished run is kept, and the note says the wall time covers this invocation.
    report, outcomes = run_study(specs, tmp_path / "study", "quick", "test run", timeout_s=300)
    assert [o.status for o in outcomes] == ["skipped (results.json exists)"]
    assert "this invocation; it kept 1 run(s) finished earlier" in report.read_text()


def test_cli_dry_run_prints_commands_with_the_thread_override(tmp_path: Path, capsys) -> None:
    from visattn.study.__main__ import main

    assert main(["--profile", "full", "--out", str(tmp_path), "--dry-run", "--cell", "mha", "--threads", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 10  # 2 tasks x 5 seeds (mha is a core cell)
    assert all(line.count("train.num_threads=") == 1 and "train.num_threads=1" in line for line in lines)
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_runner_runs_jobs_at_a_time_and_keeps_plan_order(tmp_path: Path) -> None:
    import time

    from visattn.study.plan import RunSpec

    script = tmp_path / "fake_train.py"
    script.write_text(
        "import json, sys, time, pathlib\n"
        "args = dict(a.split('=', 1) for a in sys.argv[1:])\n"
        "time.sleep(1.0)\n"
        "run = pathlib.Path(args['dir']); run.mkdir(parents=True, exist_ok=True)\n"
        "(run / 'results.json').write_text(json.dumps({'task': 'cls', 'seed': int(args['seed']),"
        " 'active_heads': [8, 8], 'top1': 0.5, 'config': {'attn': {'name': 'mha'}}}))\n"
    )
    specs = [RunSpec("cls", "mha", seed, tmp_path / "runs" / f"seed{seed}", str(script),
                     (f"seed={seed}", f"dir={tmp_path / 'runs' / f'seed{seed}'}")) for seed in range(4)]
    start = time.perf_counter()
    report, outcomes = run_study(specs, tmp_path, "quick", "jobs test", jobs=4)
    assert time.perf_counter() - start < 3.5  # four 1 s runs side by side, not 4 s in a row
    assert [o.spec.seed for o in outcomes] == [0, 1, 2, 3] and all(o.status == "done" for o in outcomes)
    assert report is not None and report.is_file()
    with pytest.raises(ValueError, match="jobs=0"):
        run_study(specs, tmp_path, "quick", "jobs test", jobs=0)


def test_runner_reruns_incomplete_runs_and_skips_finished_ones(tmp_path: Path) -> None:
    """A failed or preempted run writes results.json with completed: false; the runner launches it
    again (it resumes by itself) and skips only the runs that finished."""
    from visattn.study.plan import RunSpec
    from visattn.study.runner import run_one

    script = tmp_path / "fake_train.py"
    script.write_text(
        "import json, sys, pathlib\n"
        "run = pathlib.Path(sys.argv[1])\n"
        "with (run / 'launches.txt').open('a') as f: f.write('x')\n"
        "(run / 'results.json').write_text(json.dumps({'task': 'cls', 'completed': sys.argv[2] == 'ok'}))\n"
    )

    def spec(name: str, outcome: str, results: dict | None) -> RunSpec:
        run_dir = tmp_path / name
        run_dir.mkdir()
        if results is not None:
            (run_dir / "results.json").write_text(json.dumps(results))
        return RunSpec("cls", "mha", 0, run_dir, str(script), (str(run_dir), outcome))

    finished = spec("finished", "ok", {"task": "cls", "completed": True})
    legacy = spec("legacy", "ok", {"task": "cls"})  # no key: an older engine's finished run
    failed = spec("failed", "ok", {"task": "cls", "completed": False, "failure": "non-finite loss"})
    preempted = spec("preempted", "stop", {"task": "cls", "completed": False, "preempted": True})

    assert run_one(finished, "quick", 60).status.startswith("skipped")
    assert run_one(legacy, "quick", 60).status.startswith("skipped")
    assert run_one(failed, "quick", 60).status == "done"
    again = run_one(preempted, "quick", 60)  # exits 0 but still says completed: false
    assert again.status.startswith("incomplete") and again.failed
    assert not (finished.run_dir / "launches.txt").exists() and not (legacy.run_dir / "launches.txt").exists()
    assert (failed.run_dir / "launches.txt").read_text() == "x"
    assert (preempted.run_dir / "launches.txt").read_text() == "x"
    assert json.loads((failed.run_dir / "results.json").read_text())["completed"] is True


def test_runner_refuses_run_dirs_of_another_recipe(tmp_path: Path) -> None:
    """Resuming into a folder that holds another study's runs would report them as this study's."""
    from visattn.study.plan import RunSpec
    from visattn.study.runner import check_run_dirs

    run_dir = tmp_path / "runs" / "cls" / "00_mha" / "seed0"
    spec = RunSpec("cls", "mha", 0, run_dir, "train_cls.py", ("train.epochs=6", "seed=0", f"hydra.run.dir={run_dir}"))
    check_run_dirs([spec])  # nothing there yet
    run_dir.mkdir(parents=True)
    (run_dir / "cell.json").write_text(json.dumps({"command": spec.command}))
    check_run_dirs([spec])  # the same recipe: resumable
    # ... also after the study folder was moved: the run dir is where a run is, not what it computes
    moved = "python train_cls.py train.epochs=6 seed=0 hydra.run.dir=old/place/runs/cls/00_mha/seed0"
    (run_dir / "cell.json").write_text(json.dumps({"command": moved}))
    check_run_dirs([spec])
    (run_dir / "cell.json").write_text(json.dumps({"command": "python train_cls.py train.epochs=2 seed=0"}))
    with pytest.raises(ValueError, match="another recipe") as err:
        check_run_dirs([spec])
    assert str(run_dir) in str(err.value) and "--out" in str(err.value)


def test_report_only_covers_the_finished_runs_and_says_the_study_is_in_progress(tmp_path: Path) -> None:
    """A study run in sittings: --report-only writes REPORT.md over what finished, and its title and
    note say how much of the plan that is (a report over part of a plan must not pass for the whole)."""
    from visattn.study.__main__ import main

    out = tmp_path / "study"
    specs = plan_runs("full", out, tasks=["cls"], cells=["mha", "moh-75"])
    assert main(["--profile", "full", "--out", str(out), "--report-only"]) == 1  # nothing finished yet
    for spec in specs[:3]:  # seed 0 of both cells, seed 1 of mha
        spec.run_dir.mkdir(parents=True)
        (spec.run_dir / "results.json").write_text(json.dumps({
            "task": "cls", "attn": spec.cell.split("-")[0], "seed": spec.seed, "active_heads": [8, 8],
            "top1": 0.8 + 0.01 * spec.seed, "completed": True}))
        (spec.run_dir / "cell.json").write_text(json.dumps({"cell": spec.cell, "command": spec.command}))
    unfinished = specs[3].run_dir
    unfinished.mkdir(parents=True)
    (unfinished / "results.json").write_text(json.dumps({"task": "cls", "completed": False, "preempted": True}))
    assert main(["--profile", "full", "--out", str(out), "--report-only"]) == 0
    text = (out / "REPORT.md").read_text()
    per_task = {task: len(plan_runs("full", out, tasks=[task])) for task in ("cls", "dit")}
    planned = sum(per_task.values())
    assert planned >= 108 and per_task["cls"] == per_task["dit"]  # every cell in both tasks
    assert f"in progress: 3 of {planned} runs" in text.splitlines()[0]
    assert f"IN PROGRESS: 3 of the {planned} planned runs have finished" in text
    assert f"cls 3/{per_task['cls']}, dit 0/{per_task['dit']}" in text
    assert "| mha |" in text and "| moh-75 |" in text
    assert not any(p.name.startswith("dit_") for p in out.iterdir())  # nothing run, nothing else reported


def test_full_profile_report_checks_mha_against_the_recipe_targets(tmp_path: Path) -> None:
    """conf/study/full.yaml's targets (DiT class agreement >= 0.80, recall >= 0.30) reach the report."""
    from visattn.study.__main__ import main

    out = tmp_path / "study"
    spec = plan_runs("full", out, tasks=["dit"], cells=["mha"], seeds=[0])[0]
    spec.run_dir.mkdir(parents=True)
    (spec.run_dir / "results.json").write_text(json.dumps({
        "task": "dit", "attn": "mha", "seed": 0, "active_heads": [8, 8], "fid": 2.8, "class_agreement": 0.79,
        "recall": 0.31, "completed": True}))
    (spec.run_dir / "cell.json").write_text(json.dumps({"cell": "mha", "command": spec.command}))
    assert main(["--profile", "full", "--out", str(out), "--report-only"]) == 0
    text = (out / "REPORT.md").read_text()
    assert "### The recipe's targets (MHA)" in text
    assert "| class agreement | >= 0.800 | 0.790 (n=1, no interval) | missed by the one seed (no interval) |" in text
    assert "| recall | >= 0.300 | 0.310 (n=1, no interval) | met by the one seed (no interval) |" in text
