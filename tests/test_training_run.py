"""Modes that read a training run back (ckpt=RUN_DIR) rebuild the run's model from what it recorded."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from hydra import compose, initialize_config_dir
from test_engine_faults import cls_cfg, dit_cfg, env

from visattn.engine.cls.setup import RUN_GROUPS as CLS_GROUPS
from visattn.engine.cls.trainer import run_cls
from visattn.engine.dit.trainer import run as run_dit
from visattn.engine.training_run import (
    adopt_training_config,
    override_keys,
    training_config,
    training_run_dir,
)

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")


def adopted(overrides, modes=("eval",)):
    """train_cls.py's config for this command line, as its entry point passes it on."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train_cls", overrides=list(overrides))
    return adopt_training_config(cfg, CLS_GROUPS, overrides, modes)


def script(name, *overrides):
    """Run an entry point with exactly these overrides (none of the tests' tiny settings)."""
    return subprocess.run([sys.executable, str(ROOT / name), *overrides], env=env(), capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def mha_run(tmp_path_factory):
    """A tiny MHA classifier; the config defaults (attn=moh) would load its weights with fresh routers."""
    run_dir = tmp_path_factory.mktemp("mha_run")
    results = run_cls(cls_cfg("attn=mha", "train.epochs=1"), run_dir)
    return run_dir, results


def test_eval_of_a_run_dir_takes_the_runs_model_and_data(mha_run):
    run_dir, _ = mha_run
    cfg = adopted(["mode=eval", f"ckpt={run_dir}"])
    assert cfg.attn.name == "mha" and cfg.model.kwargs.embed_dim == 16 and cfg.model.kwargs.depth == 2
    assert "shared_heads" not in cfg.attn  # the run's group whole, not merged into the default moh
    # a key named on the command line wins over the run's; a group named there is the command line's
    cfg = adopted(["mode=eval", f"ckpt={run_dir}", "data.num_workers=3", "+attn.qk_norm=true"])
    assert cfg.data.num_workers == 3 and cfg.attn.qk_norm is True and cfg.attn.name == "mha"
    assert cfg.data.name == "digits"
    cfg = adopted(["mode=eval", f"ckpt={run_dir}", "attn=moh"])
    assert cfg.attn.name == "moh" and cfg.model.kwargs.depth == 2
    # training takes nothing from elsewhere
    assert adopted(["mode=train", f"ckpt={run_dir}"]).attn.name == "moh"


def test_the_run_dir_is_found_from_its_weight_files_and_checkpoints(mha_run):
    run_dir, _ = mha_run
    (checkpoint,) = (run_dir / "checkpoints").iterdir()
    for ckpt in (run_dir, run_dir / "best.safetensors", checkpoint, checkpoint / "model.safetensors"):
        assert training_run_dir(ckpt) == run_dir, ckpt
    assert training_run_dir(run_dir.parent / "deit_small.pth") is None  # a weight file of no run


def test_the_recorded_config_falls_back_to_hydras_and_ignores_other_modes(tmp_path):
    hydra_dir = tmp_path / ".hydra"
    hydra_dir.mkdir()
    (hydra_dir / "config.yaml").write_text(yaml.safe_dump({"mode": "train", "attn": {"name": "gqa"}}))
    (tmp_path / "results.json").write_text("{ truncated")  # a run killed mid-write of an older format
    config, source = training_config(tmp_path)
    assert config["attn"] == {"name": "gqa"} and source == hydra_dir / "config.yaml"
    (tmp_path / "results.json").write_text(json.dumps({"mode": "eval", "config": {"mode": "eval"}}))
    (hydra_dir / "config.yaml").write_text(yaml.safe_dump({"mode": "eval"}))
    assert training_config(tmp_path) is None  # an eval's run dir says nothing about a training


def test_override_keys_name_keys_and_groups():
    assert override_keys(["attn=mha", "+model.kwargs.depth=2", "~budget", "++seed=3"]) == [
        "attn", "model.kwargs.depth", "budget", "seed"]


def test_eval_into_the_training_run_dir_is_refused(mha_run):
    run_dir, _ = mha_run
    before = (run_dir / "results.json").read_text()
    with pytest.raises(ValueError, match="holds a training run's results.json, which mode=eval would replace"):
        run_cls(cls_cfg("attn=mha", "mode=eval", f"ckpt={run_dir}"), run_dir)
    assert (run_dir / "results.json").read_text() == before


def test_train_cls_eval_of_a_run_dir_reproduces_its_top1(mha_run, tmp_path):
    run_dir, results = mha_run
    done = script("train_cls.py", "mode=eval", f"ckpt={run_dir}", "train.progress=false",
                  f"hydra.run.dir={tmp_path / 'eval'}")
    assert done.returncode == 0, done.stderr[-3000:]
    evaluated = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert evaluated["attn"] == "mha" and evaluated["active_ratio"] == 1.0
    assert evaluated["top1"] == results["top1_best"]


def test_train_dit_sample_of_a_run_dir_builds_the_runs_model(tmp_path):
    run_dir = tmp_path / "train"
    run_dit(dit_cfg("train.steps=2", "sample.steps=4"), run_dir)  # DiT-T/2 at width 32, depth 2: not the defaults
    done = script("train_dit.py", "mode=sample", f"ckpt={run_dir}", "sample.num_samples=2",
                  f"hydra.run.dir={tmp_path / 'sample'}")
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(tmp_path / "sample" / "samples.npz") as samples:
        images = samples["arr_0"]
    assert images.shape[0] == 2 and images.shape[1:3] == (8, 8)  # digits at 8 px, as the run trained
