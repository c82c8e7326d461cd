"""A run dir belongs to one run: resume continues only a checkpoint its own config made."""

import json
import subprocess

import pytest
from test_engine_faults import cls_cfg, env, script

from visattn.engine.checkpoints import latest_checkpoint
from visattn.engine.cls.trainer import run_cls
from visattn.engine.run_identity import RunMismatch, check_same_run, run_definition


def test_the_definition_leaves_out_how_a_run_is_executed():
    config = {"seed": 0, "device": "cpu", "resume": "auto", "train": {"epochs": 2, "num_threads": 4, "progress": True},
              "model": {"name": "vit", "kwargs": {"depth": 2}}, "data": {"name": "digits", "num_workers": 8}}
    assert run_definition(config) == {"data.name": "digits", "model.kwargs.depth": 2, "model.name": "vit",
                                      "seed": 0, "train.epochs": 2}


def test_differences_are_named_and_only_a_longer_training_continues_the_run(tmp_path):
    saved = {"seed": 0, "train.epochs": 2, "attn.name": "moh"}
    assert check_same_run(saved, dict(saved), tmp_path, 22, force=False) == {}
    assert check_same_run(saved, {**saved, "train.epochs": 4}, tmp_path, 22, force=False) == {
        "continued_from": {"train.epochs": 2}}
    with pytest.raises(RunMismatch, match=r"step 22\) of another run: seed 0 -> 2, train.epochs 2 -> 1\. Nothing"):
        check_same_run(saved, {**saved, "seed": 2, "train.epochs": 1}, tmp_path, 22, force=False)
    with pytest.raises(RunMismatch, match=r"attn.name 'moh' -> \(absent\)"):
        check_same_run(saved, {"seed": 0, "train.epochs": 2}, tmp_path, 22, force=False)
    assert check_same_run(saved, {**saved, "seed": 2}, tmp_path, 22, force=True) == {
        "resumed_despite": {"seed": [0, 2]}}


def test_another_run_into_a_finished_run_dir_is_refused_before_anything_is_written(tmp_path):
    """The issue's case: seed=2 train.epochs=1 into the dir of a finished seed-0, 2-epoch run."""
    run_dir = tmp_path / "run"
    first = subprocess.run(script("train_cls.py", run_dir, "seed=0"), env=env(), capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    files = ("results.json", ".hydra/config.yaml", ".hydra/overrides.yaml", "metrics.csv", "best.safetensors")
    before = {name: (run_dir / name).read_bytes() for name in files}
    checkpoint = latest_checkpoint(run_dir)

    refused = subprocess.run(script("train_cls.py", run_dir, "seed=2", "train.epochs=1"), env=env(),
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1
    assert "holds a checkpoint (step 22) of another run: seed 0 -> 2, train.epochs 2 -> 1" in refused.stderr
    assert "force_resume=true" in refused.stderr and "hydra.run.dir=" in refused.stderr
    assert {name: (run_dir / name).read_bytes() for name in files} == before
    assert latest_checkpoint(run_dir).path == checkpoint.path
    assert "seed 0 -> 2" in (run_dir / "train_cls.log").read_text()  # the run's log says why


def test_force_resume_continues_anyway_and_results_say_so(tmp_path):
    run_cls(cls_cfg("train.epochs=1"), tmp_path)
    results = run_cls(cls_cfg("train.epochs=1", "optim.lr=1e-4", "force_resume=true"), tmp_path)
    assert results["resumed_despite"] == {"optim.lr": [cls_cfg().optim.lr, 1e-4]}
    assert json.loads((tmp_path / "results.json").read_text())["resumed_despite"] == results["resumed_despite"]
    continued = run_cls(cls_cfg("train.epochs=2"), tmp_path)  # its own config, trained longer
    assert continued["continued_from"] == {"train.epochs": 1} and continued["epochs"] == 2
    assert "resumed_despite" not in continued
