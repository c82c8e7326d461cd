"""Faults a cluster run meets, on tiny runs: non-finite training, a kill during a checkpoint save,
unreadable checkpoint files, SIGTERM (preemption), two runs into one run dir, file modes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from visattn.engine import checkpoints
from visattn.engine.checkpoints import latest_checkpoint, remove_stale, save_checkpoint, verify_checkpoint
from visattn.engine.cls.trainer import run_cls
from visattn.engine.dit.trainer import run as run_dit
from visattn.engine.guard import NonFiniteError, NonFiniteGuard
from visattn.engine.preempt import PREEMPTED_EXIT_CODE, Preempted
from visattn.engine.runlock import LOCK_FILE, RunDirBusy, RunLock
from visattn.utils.checkpoint import atomic_write_bytes, load_train_state, load_weights, save_weights

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
# Runs that a test compares train in one precision: under train.amp=auto each run's timed probe
# decides, and near its margin two runs of one config can decide differently.
ONE_PRECISION = "train.amp=none"
CLS_TINY = [
    "+model.kwargs.embed_dim=16", "+model.kwargs.depth=2", "+model.kwargs.num_heads=4", "train.epochs=2",
    "sched.warmup_epochs=0", "train.batch_size=128", "train.tensorboard=false", "train.progress=false",
    "train.num_threads=null", "aug=none",
    ONE_PRECISION,
]
DIT_TINY = [
    "dit.preset=DiT-T/2", "attn=moh", "+dit.overrides.hidden_size=32", "+dit.overrides.depth=2",
    "train.batch_size=8", "train.log_every=1", "train.tensorboard=false", "eval.enabled=false",
    ONE_PRECISION,
]


def cls_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("train_cls", overrides=[*CLS_TINY, *overrides])


def dit_cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return OmegaConf.to_container(compose("train_dit", overrides=[*DIT_TINY, *overrides]), resolve=True)


def script(name, run_dir, *overrides):
    tiny = CLS_TINY if name == "train_cls.py" else DIT_TINY
    return [sys.executable, str(ROOT / name), *tiny, *overrides, f"hydra.run.dir={run_dir}"]


def env():
    """The environment of an entry point run as a subprocess: the repository first on its path."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


# ------------------------------------------------------------------ non-finite training

def test_diverging_runs_stop_with_an_error_and_never_save_nan(tmp_path):
    """lr = 1e6 on both entry points: non-zero exit, results.json says why, no NaN weights on disk."""
    runs = {
        "cls": script("train_cls.py", tmp_path / "cls", "optim.lr=1e6"),
        "dit": script("train_dit.py", tmp_path / "dit", "train.lr=1e6", "train.steps=40", "train.ckpt_every=1"),
    }
    procs = {k: subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for k, cmd in runs.items()}
    for task, proc in procs.items():
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 1, err[-2000:]
        assert "Likely causes" in err and "learning rate" in err
        results = json.loads((tmp_path / task / "results.json").read_text())
        assert results["completed"] is False and results["failure"]["reason"] == "non_finite"
        assert results["failure"]["consecutive"] == 6  # train.max_nonfinite_steps=5 tolerated, the 6th stops
        for weights in [*(tmp_path / task).rglob("*.safetensors")]:
            assert all(torch.isfinite(t).all() for t in load_weights(weights).values()), weights


def test_a_bad_value_is_written_to_the_runs_own_log(tmp_path):
    """On a cluster stderr goes elsewhere: the run dir's log names the bad value and the fix too."""
    runs = {
        "cls": script("train_cls.py", tmp_path / "cls", "budget.num_heads=[4,4,4]"),
        "dit": script("train_dit.py", tmp_path / "dit", "train.batch_size=0"),
    }
    procs = {k: subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for k, cmd in runs.items()}
    for task, proc in procs.items():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err[-2000:]
        logged = (tmp_path / task / f"train_{task}.log").read_text()
        assert "ERROR" in logged and ("num_heads has 3 entries" if task == "cls" else "train.batch_size=0") in logged


def test_guard_skips_counts_and_resets():
    guard = NonFiniteGuard(limit=1, cause_hint="lr")
    assert guard.check(0, 1.0, 1.0)
    assert not guard.check(1, float("nan"), 1.0)
    assert guard.check(2, 1.0, 2.0) and guard.consecutive == 0 and guard.skipped == 1
    assert not guard.check(3, 1.0, float("inf"))
    with pytest.raises(NonFiniteError, match=r"step 4: the gradient norm was inf for 2 steps.*Likely causes: lr"):
        guard.check(4, 1.0, float("inf"))


# ------------------------------------------------------------------ atomic checkpoints

def _save(run_dir, step):
    weights = {checkpoints.MODEL_WEIGHTS: {"w": torch.full((3,), float(step))}}
    return save_checkpoint(run_dir, step, weights, {"step": step, "optimizer": {}})


class Crash(Exception):
    pass


def _crash(*args, **kwargs):
    raise Crash


@pytest.mark.parametrize("point", ["between_files", "before_manifest", "before_rename", "after_rename"])
def test_a_kill_at_any_point_of_a_save_leaves_a_complete_checkpoint(point, tmp_path, monkeypatch):
    _save(tmp_path, 1)
    target = {"between_files": (checkpoints, "save_train_state"), "before_manifest": (checkpoints, "_write_manifest"),
              "before_rename": (checkpoints.os, "rename"), "after_rename": (checkpoints.shutil, "rmtree")}[point]
    with monkeypatch.context() as patch:
        patch.setattr(*target, _crash)
        with pytest.raises(Crash):
            _save(tmp_path, 2)
    found = latest_checkpoint(tmp_path)
    expected = 2 if point == "after_rename" else 1
    assert found.step == expected and found.weights()["w"][0].item() == expected
    assert found.state()["step"] == expected
    remove_stale(tmp_path)  # what a restarted run does under its lock
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [f"step-{expected:09d}"]


def test_resume_after_a_crash_during_save_continues_exactly(tmp_path, monkeypatch):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_dit(dit_cfg("train.steps=4", "train.ckpt_every=2"), straight)
    real_rename = checkpoints.os.rename

    def rename(src, dst):
        if str(dst).endswith("step-000000004"):
            raise Crash
        real_rename(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoints.os, "rename", rename)
        with pytest.raises(Crash):
            run_dit(dit_cfg("train.steps=4", "train.ckpt_every=2"), crashed)
    assert latest_checkpoint(crashed).step == 2 and list((crashed / "checkpoints").glob("*.tmp-*"))
    run_dit(dit_cfg("train.steps=4", "train.ckpt_every=2"), crashed)  # resume: auto, the default
    assert not list((crashed / "checkpoints").glob("*.tmp-*"))
    a, b = latest_checkpoint(straight), latest_checkpoint(crashed)
    for part in ("model.safetensors", "ema.safetensors"):
        wa, wb = a.weights(part), b.weights(part)
        assert all(torch.equal(wa[k], wb[k]) for k in wa), part


def test_unreadable_files_name_the_file_and_the_format(tmp_path):
    save_weights(tmp_path / "w.safetensors", {"w": torch.ones(100)})
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut.safetensors is not readable as a safetensors file.*truncated"):
        load_weights(tmp_path / "cut.safetensors")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file at all")
    for loader in (load_weights, load_train_state):
        with pytest.raises(ValueError, match=r"junk.pt is not readable as a torch.save file"):
            loader(tmp_path / "junk.pt")
    ckpt = _save(tmp_path / "run", 3)
    (ckpt.path / "state.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"state.pt should be \d+ bytes as .*manifest.json records"):
        verify_checkpoint(ckpt.path)
    (ckpt.path / "manifest.json").write_text("{")
    with pytest.raises(ValueError, match=r"manifest.json is not a visattn-checkpoint/1 manifest"):
        verify_checkpoint(ckpt.path)


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_files_follow_the_umask(umask, tmp_path):
    old = os.umask(umask)
    try:
        atomic_write_bytes(tmp_path / "r.json", b"{}")
        ckpt = _save(tmp_path, 1)
    finally:
        os.umask(old)
    for path in (tmp_path / "r.json", ckpt.path / "model.safetensors", ckpt.path / "manifest.json"):
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path


# ------------------------------------------------------------------ preemption

def test_sigterm_saves_and_exits_then_the_run_resumes_to_completion(tmp_path):
    run_dir = tmp_path / "run"
    cmd = script("train_dit.py", run_dir, "train.steps=100000", "train.ckpt_every=100000")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    metrics = run_dir / "metrics.csv"  # a row is logged every step, inside the training loop
    while time.time() < deadline and proc.poll() is None and not (
            metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-2000:]
    found = latest_checkpoint(run_dir)
    assert found is not None and found.step >= 1
    results = json.loads((run_dir / "results.json").read_text())
    assert results["completed"] is False and results["preempted"] is True and results["train_steps"] == found.step
    assert not (run_dir / LOCK_FILE).exists()
    # a shorter training than the checkpoint's run: another run, continued only when asked (run_identity)
    done = run_dit(dit_cfg(f"train.steps={found.step + 2}", "resume=true", "force_resume=true"), run_dir)
    assert done["completed"] is True and done["train_steps"] == found.step + 2
    assert done["resumed_despite"] == {"train.steps": [100000, found.step + 2]}
    assert json.loads((run_dir / "results.json").read_text())["completed"] is True


def test_classification_preempted_mid_epoch_resumes_there(tmp_path, signal_at_step):
    import visattn.engine.cls.trainer as trainer

    signal_at_step(trainer, 3, signal.SIGUSR1)
    with pytest.raises(Preempted, match="SIGUSR1 after step 3"):
        run_cls(cls_cfg(), tmp_path)
    state = latest_checkpoint(tmp_path).state()
    assert (state["epoch"], state["batches"], state["step"]) == (0, 3, 3)
    assert json.loads((tmp_path / "results.json").read_text())["preempted"] is True
    results = run_cls(cls_cfg(), tmp_path)  # resume: auto
    assert results["completed"] is True and results["train_steps"] == 2 * (1437 // 128)


# ------------------------------------------------------------------ one live run per run dir

def test_a_second_run_into_a_live_run_dir_is_refused(tmp_path):
    module = ROOT / "visattn" / "engine" / "runlock.py"  # loaded alone: no torch import, a fast start
    holder = subprocess.Popen(
        [sys.executable, "-c", "import importlib.util as u, time\n"
         f"spec = u.spec_from_file_location('runlock', {str(module)!r}); m = u.module_from_spec(spec)\n"
         f"spec.loader.exec_module(m)\nwith m.RunLock({str(tmp_path)!r}):\n    print('held', flush=True); time.sleep(60)"],
        env=env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=rf"in use by pid {holder.pid} on host .*delete .*{LOCK_FILE}"):
            run_cls(cls_cfg(), tmp_path)
        assert not (tmp_path / "checkpoints").exists()
        refused = subprocess.run(script("train_dit.py", tmp_path), env=env(), capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode == 1 and f"in use by pid {holder.pid}" in refused.stderr
        assert not (tmp_path / ".hydra").exists()  # refused before Hydra wrote over the live run's config
    finally:
        holder.kill()
        holder.wait()
    # The holder died without releasing: the lock is stale (same host, dead pid) and is taken over.
    with RunLock(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()


def test_default_run_dirs_differ_for_runs_started_in_the_same_second():
    from visattn.engine.launch import register_resolvers

    register_resolvers()
    for name in ("train_cls", "train_dit"):
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose(name, return_hydra_config=True)
        assert OmegaConf.to_container(cfg.hydra.run)["dir"].endswith("-${pid:}")
    assert OmegaConf.create({"d": "x-${pid:}"}).d == f"x-{os.getpid()}"


def test_a_stop_signal_anywhere_in_a_run_is_recorded_and_the_run_stops_at_its_next_safe_point():
    """Start-up, a training step, the final evaluation: the signal never kills the process mid-way;
    the run saves and raises ``Preempted`` where it checks (``stop_checked`` for evaluation batches)."""
    from visattn.engine.preempt import StopSignal, stop_checked

    with StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing
        assert stop.received == signal.SIGUSR1
        seen = []
        with pytest.raises(Preempted, match="SIGUSR1 after step 7"):
            for batch in stop_checked([1, 2, 3], stop, step=7, device=torch.device("cpu")):
                seen.append(batch)
        assert seen == []  # checked before each batch
    with StopSignal() as quiet:
        assert list(stop_checked([1, 2, 3], quiet, step=0, device=torch.device("cpu"))) == [1, 2, 3]


@pytest.mark.parametrize("slurm, rank, expected", [(False, "0", PREEMPTED_EXIT_CODE), (False, "1", PREEMPTED_EXIT_CODE),
                                                   (True, "0", PREEMPTED_EXIT_CODE), (True, "1", 0)])
def test_exit_codes_after_a_saved_stop(monkeypatch, slurm, rank, expected):
    """75 (try again) everywhere, except the other ranks of a SLURM step: 0, so that srun's
    --kill-on-bad-exit cannot stop rank 0 while it requeues the job."""
    from visattn.engine.preempt import exit_preempted

    for var in ("SLURM_JOB_ID", "SUBMITIT_EXECUTOR", "SUBMITIT_FOLDER"):
        monkeypatch.delenv(var, raising=False)
    if slurm:
        monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exited:
        exit_preempted(Preempted(signal.SIGUSR2, 5))
    assert exited.value.code == expected


def test_a_submitit_job_that_was_not_requeued_fails_instead_of_leaving_the_sweep_waiting(monkeypatch):
    from visattn.engine.preempt import exit_preempted

    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    stopped = Preempted(signal.SIGUSR2, 5)
    stopped.not_requeued = "timed-out too many times"
    with pytest.raises(RuntimeError, match="not requeued: timed-out too many times"):
        exit_preempted(stopped)


def test_a_requeued_slurm_job_takes_over_the_lock_of_its_earlier_instance_only(tmp_path, monkeypatch):
    """Same job id and a lower restart count: an instance SLURM has ended (on any host). Same job and
    restart on another host: another task of this very job, alive as far as anyone can tell."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = tmp_path / LOCK_FILE
    lock.write_text(json.dumps({"host": "node-a", "pid": 1, "slurm_job_id": "4242", "slurm_restart": 0}))
    with RunLock(tmp_path):
        pass
    lock.write_text(json.dumps({"host": "node-a", "pid": 1, "slurm_job_id": "4242", "slurm_restart": 1}))
    with pytest.raises(RunDirBusy, match="pid 1 on host node-a"):
        RunLock(tmp_path).acquire()
    lock.write_text(json.dumps({"host": "node-a", "pid": 1, "slurm_job_id": "999"}))
    with pytest.raises(RunDirBusy, match="pid 1 on host node-a"):
        RunLock(tmp_path).acquire()


def test_an_unreadable_lock_is_not_taken_over(tmp_path):
    (tmp_path / LOCK_FILE).write_text("")
    with pytest.raises(RunDirBusy, match=f"unreadable lock file.*delete {tmp_path / LOCK_FILE}"):
        RunLock(tmp_path).acquire()


def test_a_rank_stopped_by_another_ranks_signal_exits_preempted():
    """Under DDP the ranks agree on stopping: a rank that got no signal itself still stops as preempted."""
    from visattn.engine.preempt import StopSignal

    with StopSignal() as stop:
        assert not stop.requested
        stopped = stop.preempted(step=3)
    assert isinstance(stopped, Preempted) and stopped.signum == signal.SIGTERM and stopped.step == 3
