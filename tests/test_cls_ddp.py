"""train_cls.py under torchrun with 2 CPU processes (gloo): one run dir, one results.json."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from test_engine_faults import ONE_PRECISION, env

from visattn.engine.checkpoints import latest_checkpoint
from visattn.kernels import moh_routed_heads_op

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "+model.kwargs.embed_dim=16", "+model.kwargs.depth=2", "+model.kwargs.num_heads=4", "train.epochs=2",
    "sched.warmup_epochs=1", "train.batch_size=128", "train.tensorboard=false", "train.progress=false",
    "aug=none", "data=digits",
    "device=cpu",  # gloo: a machine with a GPU may still have fewer GPUs than ranks
    ONE_PRECISION,
]


def test_torchrun_two_processes_share_one_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train_cls.py"), *TINY, "train.attn_paths=probe", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert not (run_dir / ".run.lock").exists()  # rank 0 held it and let it go  # rank 1 made no run dir of its own
    results = json.loads((run_dir / "results.json").read_text())
    assert results["world_size"] == 2
    assert results["train_steps"] == 2 * (1437 // 128)  # the global batch is split over the ranks
    assert 0.0 <= results["top1"] <= 1.0
    # the MoH training paths: rank 0's probe, taken by both ranks (a collective every rank joins)
    probed = {"blocks.0.attn", "blocks.1.attn"} if moh_routed_heads_op(torch.float32, blas=False) else set()
    assert set(results["attention_train_paths"]["paths"]) == probed
    assert latest_checkpoint(run_dir).state()["attention_train_paths"] == results["attention_train_paths"]
    state_rngs = latest_checkpoint(run_dir).state()["rng"]
    assert len(state_rngs) == 2 and not torch.equal(state_rngs[0]["torch"], state_rngs[1]["torch"])
    summary = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(summary) == 1 and json.loads(summary[0])["top1"] == results["top1"]


def test_a_resumed_ddp_run_logs_the_losses_of_an_uninterrupted_one(tmp_path):
    """SIGUSR1 to rank 0 in epoch 2 of a 2-process run, then a resume: every rank's running sums were
    reduced into the checkpoint, so epoch 2's logged loss is the uninterrupted run's (it was rank 0's alone)."""
    tiny = [*TINY, "train.batch_size=32", "train.epochs=2"]  # 44 steps an epoch: a stop lands mid-epoch

    def torchrun(run_dir, *extra, progress=False):
        args = [a for a in tiny if not a.startswith("train.progress=")] + [f"train.progress={str(progress).lower()}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "train_cls.py"), *args, *extra, f"hydra.run.dir={run_dir}"]
        return subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    whole = torchrun(tmp_path / "whole")
    # Rank 0's progress bar says when epoch 2 has taken a step: the stop then lands mid-epoch however
    # slow the machine (waiting for epoch 1's metrics row alone raced the start of epoch 2).
    stopped = torchrun(tmp_path / "stopped", progress=True)
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(lambda: stopped.stdout.read(1), "")), daemon=True)
    reader.start()
    in_epoch_2 = re.compile(r"epoch 2/2:\s*\d+%\|[^|]*\|\s*[1-9]\d*/\d+")
    deadline = time.monotonic() + 240
    while not in_epoch_2.search("".join(seen)) and time.monotonic() < deadline:
        assert stopped.poll() is None, "".join(seen)[-3000:]
        time.sleep(0.05)
    lock = json.loads((tmp_path / "stopped" / ".run.lock").read_text())  # rank 0 holds it
    os.kill(lock["pid"], signal.SIGUSR1)
    stopped.wait(timeout=240)
    reader.join(timeout=30)
    out = "".join(seen)
    assert stopped.returncode != 0 and "stopped by SIGUSR1" in out, out[-3000:]
    assert latest_checkpoint(tmp_path / "stopped").state()["batches"] > 0  # mid-epoch
    resumed = torchrun(tmp_path / "stopped")
    for proc in (resumed, whole):
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]

    def losses(run_dir):
        with open(run_dir / "metrics.csv") as f:
            return [(row["epoch"], row["loss"]) for row in csv.DictReader(f)]

    assert losses(tmp_path / "stopped") == losses(tmp_path / "whole")
