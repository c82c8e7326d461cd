"""train_dit.py under torchrun with 2 CPU processes (gloo): one run dir, one results.json, and the
evaluation samples equal a one-process run's from the same checkpoint (every rank's EMA starts from
the same weights)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_engine_faults import ONE_PRECISION, env

from visattn.engine.dit.sampling import all_labels
from visattn.engine.dit.setup import sample_settings
from visattn.engine.dit.trainer import run

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "dit.preset=DiT-T/2", "attn=moh", "+dit.overrides.hidden_size=32", "+dit.overrides.depth=2",
    "train.batch_size=8", "train.log_every=1", "train.tensorboard=false", "train.steps=3",
    "train.lr=1e-2", "train.ema_decay=0.5", "eval.num_samples=8", "eval.fid_step0=false", "eval.head_load_images=16", "sample.steps=4", "sample.grid=8",
    "device=cpu",  # gloo: a machine with a GPU may still have fewer GPUs than ranks
    ONE_PRECISION,
]


def test_torchrun_two_processes_share_one_run_dir_and_sample_like_one(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train_dit.py"), *TINY, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # rank 1 made no run dir of its own
    results = json.loads((run_dir / "results.json").read_text())
    assert results["completed"] is True and results["train_steps"] == 3
    assert not (run_dir / ".run.lock").exists()

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train_dit", overrides=[*TINY, "mode=sample", f"ckpt={run_dir}", "sample.num_samples=8"])
    run(OmegaConf.to_container(cfg, resolve=True), tmp_path / "one")
    with np.load(run_dir / "samples.npz") as two, np.load(tmp_path / "one" / "samples.npz") as one:
        np.testing.assert_array_equal(two["arr_0"], one["arr_0"])  # every sample, odd indices included (labels are a function of the index)
        np.testing.assert_array_equal(two["arr_1"], one["arr_1"])  # labels in index order, as the images
        np.testing.assert_array_equal(one["arr_1"], all_labels(sample_settings(cfg), 8, 10))
    assert 0.0 <= results["class_agreement"] <= 1.0
