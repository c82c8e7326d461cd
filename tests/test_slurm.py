"""The cluster path on a real SLURM (Debian's slurm-wlm + munge, brought up by ``slurm_cluster``).
A single-node cluster: hydra/launcher=slurm_cpu sweeps, multi-task jobs as one DDP run, every stop
requeued and finished bit-identical to an uninterrupted run. A two-node one (each slurmd in its own
network namespace with its own address and host name): a multi-node job and preemption. Skipped,
saying why, where SLURM (or network namespaces) cannot be brought up.

Jobs run concurrently (a node declares more CPUs than the machine has), so the module takes about as
long as its slowest jobs; conftest.py starts it first, so the rest of the suite runs beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file
from slurm_cluster import SlurmCluster, unavailable
from test_engine_faults import ONE_PRECISION

from visattn.engine.checkpoints import MODEL_WEIGHTS, latest_checkpoint
from visattn.engine.runlock import LOCK_FILE

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[1]
CLS = [
    "+model.kwargs.embed_dim=16", "+model.kwargs.depth=2", "+model.kwargs.num_heads=4", "attn=mha",
    "sched.warmup_epochs=0", "train.batch_size=128", "train.tensorboard=false", "train.progress=false",
    "train.num_threads=1", "aug=none", "device=cpu", ONE_PRECISION,
]
DIT = [
    "dit.preset=DiT-T/2", "attn=mha", "+dit.overrides.hidden_size=32", "+dit.overrides.depth=2",
    "train.batch_size=8", "train.log_every=1", "train.tensorboard=false", "train.progress=false",
    "train.num_threads=1", "device=cpu", ONE_PRECISION,
]
LAUNCHER = ["hydra/launcher=slurm_cpu", "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
            "hydra.launcher.partition=steady"]
STOP_EPOCHS = "train.epochs=12"  # a job is stopped once an epoch of its sitting is logged: mid-run


def env(cluster: SlurmCluster) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**cluster.env, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


@pytest.fixture(autouse=True)
def cleanup():
    """A failed test leaves no -m process waiting for its jobs."""
    yield
    while Sweep.running:
        proc = Sweep.running.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(why)
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), cpus=32) as up:
        yield up


class Sweep:
    """``python train_*.py -m hydra/launcher=slurm_cpu ...`` running in the background (ended, if still
    running, when the test ends: see ``cleanup``)."""

    running: list[subprocess.Popen] = []

    def __init__(self, cluster: SlurmCluster, folder: Path, script: str, *overrides: str) -> None:
        self.cluster, self.dir = cluster, folder
        cmd = [sys.executable, str(ROOT / script), "-m", *LAUNCHER, *overrides, f"hydra.sweep.dir={folder}",
               "hydra.sweep.subdir=${hydra.job.num}"]
        self.proc = subprocess.Popen(cmd, cwd=folder.parent, env=env(cluster), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        Sweep.running.append(self.proc)

    def run_dirs(self) -> list[Path]:
        return sorted(p for p in self.dir.iterdir() if p.is_dir() and p.name[0].isdigit()) if self.dir.is_dir() else []

    def job_id(self, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [p.name for p in (self.dir / ".submitit").glob("*") if re.fullmatch(r"\d+(_\d+)?", p.name)]
            if found:
                return sorted(found)[0]
            time.sleep(0.2)
        raise TimeoutError(f"no job submitted by {self.dir}")

    def wait_training(self, sitting: int, timeout: float = 240) -> None:
        """Until the job's ``sitting``-th run (0: the first; n: after n resumes) has trained an epoch."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for run_dir in self.run_dirs():
                log = _log(run_dir, "train_cls")
                if log.count("resumed from") == sitting and re.search(r"epoch \d+/\d+: loss", log.split("resumed from")[-1]):
                    return
            assert self.proc.poll() is None, self.output()
            time.sleep(0.2)
        raise TimeoutError(f"{self.dir}: sitting {sitting} trained no epoch after {timeout:.0f} s")

    def pause_when_training(self) -> Paused:
        """SIGSTOP the job's (rank 0) process once it has trained an epoch."""
        self.wait_training(0)
        (run_dir,) = self.run_dirs()
        pid = json.loads((run_dir / LOCK_FILE).read_text())["pid"]
        os.kill(pid, signal.SIGSTOP)
        return Paused(pid)

    def output(self) -> str:
        return self.proc.stdout.read() if self.proc.poll() is not None else "(running)"

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, "\n".join(line for line in out.splitlines() if "sacct" not in line
                                               and "accounting storage" not in line)


class Paused:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def resume_when_signalled(self, signum: int, timeout: float) -> None:
        """SIGCONT once ``signum`` is pending for the paused process (it acts on it then). SLURM itself
        sends SIGCONT with the signals it delivers, so the process may be running, or gone, already."""
        bit = 1 << (signum - 1)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    status = Path(f"/proc/{self.pid}/status").read_text()
                except FileNotFoundError:
                    return
                pending = [int(line.split()[1], 16) for line in status.splitlines() if line[:6] in ("SigPnd", "ShdPnd")]
                if any(mask & bit for mask in pending) or "\nState:\tT" not in status:
                    return
                time.sleep(0.2)
            raise TimeoutError(f"no {signal.Signals(signum).name} for pid {self.pid} after {timeout:.0f} s")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)


def direct_run(cluster, folder: Path, script: str, *overrides: str, ranks: int = 1) -> Path:
    """The same run outside SLURM (``python`` or ``torchrun``): the uninterrupted reference."""
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc_per_node={ranks}"]
    clean = {k: v for k, v in env(cluster).items() if not k.startswith("SLURM_")}
    proc = subprocess.Popen([*launcher, str(ROOT / script), *overrides, f"hydra.run.dir={folder}"],
                            cwd=folder.parent, env=clean, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    proc.folder = folder
    return proc


def finished(proc) -> Path:
    """The run dir of a ``direct_run``, once it has ended well (any number of calls)."""
    if proc.returncode is None:
        proc.output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, proc.output[-3000:]
    return proc.folder


def final_weights(run_dir: Path) -> dict:
    return load_file(latest_checkpoint(run_dir).path / MODEL_WEIGHTS)


def assert_same_weights(run_dir: Path, reference: Path) -> None:
    got, want = final_weights(run_dir), final_weights(reference)
    assert got.keys() == want.keys()
    different = [k for k in want if not (got[k] == want[k]).all()]
    assert not different, f"{run_dir} differs from the uninterrupted run in {different[:5]}"


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


# ---------------------------------------------------------------------------------------------------

def test_a_request_no_node_can_hold_is_refused_before_submission(cluster, tmp_path):
    """The GPU preset on a CPU-only cluster: refused at once with the numbers, no job left pending."""
    proc = subprocess.run([sys.executable, str(ROOT / "train_cls.py"), "-m", "hydra/launcher=slurm",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}", *CLS, "train.epochs=1"],
                          cwd=tmp_path, env=env(cluster), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert re.search(r"no 1 node\(s\) of the default partition can ever run this job: asked for 1 node\(s\) each "
                     r"with 8 tasks x 10 CPUs = 80 CPUs, 8 GPUs, 480 GB; 0 of its 1 node\(s\) fit, the largest "
                     rf"\({cluster.nodes[0]}\) has 32 CPUs, 0 GPUs", proc.stderr), proc.stderr[-2000:]
    assert "hydra/launcher=slurm_cpu" in proc.stderr
    assert not (tmp_path / "sweep" / ".submitit").exists()  # nothing was submitted


@pytest.fixture(scope="module")
def references(cluster, tmp_path_factory):
    """The uninterrupted runs the cluster's runs are compared with, started at once, in the background."""
    folder = tmp_path_factory.mktemp("references")
    return {
        "stop": direct_run(cluster, folder / "stop", "train_cls.py", *CLS, STOP_EPOCHS),
        "ddp_cls": direct_run(cluster, folder / "ddp_cls", "train_cls.py", *CLS, "train.epochs=2", ranks=2),
        "ddp_dit": direct_run(cluster, folder / "ddp_dit", "train_dit.py", *DIT, "train.steps=4", "eval.enabled=false",
                              ranks=2),
    }


def test_sweeps_multi_task_jobs_and_every_stop_on_a_real_cluster(cluster, references, tmp_path):
    """All at once on the one node (each job its own -m process):

    - a two-job sweep (attn=mha,moh);
    - a two-task job of each task: one DDP run (one run dir, world_size 2), the weights of
      ``torchrun --nproc_per_node=2``;
    - a classification job stopped in turn by SIGUSR2 (submitit's signal), SIGUSR1, SIGTERM sent alone
      (``scancel --signal=TERM``) and ``scontrol requeue``, and one by SLURM's time limit: each time
      requeued (by the job itself, or SLURM) and resumed, finished bit-identical to an uninterrupted
      run (a stop during the final sampling: tests/test_dit_train.py);
    - a job cancelled (``scancel`` without ``--signal``): saved, not requeued, the sweep fails saying so;
    - a failing two-task job: the sweep fails, the run's log says why.
    """
    two_tasks = ["hydra.launcher.tasks_per_node=2"]
    sweeps = {
        "sweep": Sweep(cluster, tmp_path / "sweep", "train_cls.py", *CLS, "train.epochs=1", "attn=mha,moh"),
        "ddp_cls": Sweep(cluster, tmp_path / "ddp_cls", "train_cls.py", *CLS, "train.epochs=2", *two_tasks),
        "ddp_dit": Sweep(cluster, tmp_path / "ddp_dit", "train_dit.py", *DIT, "train.steps=4", "eval.enabled=false",
                         *two_tasks),
        "failing": Sweep(cluster, tmp_path / "failing", "train_cls.py", *CLS, "train.batch_size=129", *two_tasks),
        "stops": Sweep(cluster, tmp_path / "stops", "train_cls.py", *CLS, STOP_EPOCHS),
        "cancelled": Sweep(cluster, tmp_path / "cancelled", "train_cls.py", *CLS, STOP_EPOCHS),
        # its limit is brought near once it trains (run_into_the_time_limit)
        "time_limit": Sweep(cluster, tmp_path / "time_limit", "train_cls.py", *CLS, STOP_EPOCHS,
                            "hydra.launcher.timeout_min=10", "hydra.launcher.signal_delay_s=120"),
    }
    # a batch script of the user's own: srun starts the two tasks of one run
    srun_dir = tmp_path / "srun"
    overrides = " ".join(f"'{o}'" for o in [*CLS, "train.epochs=2", f"hydra.run.dir={srun_dir}"])
    srun_job = subprocess.run(
        ["sbatch", "--parsable", "-p", "steady", "-n", "2", "-o", str(tmp_path / "srun.out"), "--wrap",
         f"srun --kill-on-bad-exit=1 {sys.executable} {ROOT / 'train_cls.py'} {overrides}"],
        env=env(cluster), cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    limited = sweeps["time_limit"]
    stops = {"stops": [["scancel", "--signal=USR2"], ["scancel", "--signal=USR1"], ["scancel", "--signal=TERM"],
                       ["scontrol", "requeue"]],
             "cancelled": [["scancel"]]}

    def stop_in_turn(name: str) -> None:
        for sitting, command in enumerate(stops[name]):
            sweeps[name].wait_training(sitting)
            _signal(cluster, command, sweeps[name].job_id())

    def run_into_the_time_limit() -> Path:
        # Paused (SIGSTOP) once it trains, so that SLURM's signal finds it mid-run however fast it trains
        # here; its limit is then brought to 90-150 s away, within signal_delay_s (120) + SLURM's 30-s check
        # interval, so the time-limit signal comes at the next check; resumed (SIGCONT) once it is pending.
        paused = limited.pause_when_training()
        elapsed = _seconds(cluster.job_field(limited.job_id(), "RunTime"))
        cluster.scontrol("update", f"JobId={limited.job_id()}", f"TimeLimit={-(-(elapsed + 90) // 60)}")
        paused.resume_when_signalled(signal.SIGUSR2, timeout=120)
        run_dir = _wait_for(lambda: next((d for d in limited.run_dirs() if "Requeued job" in _log(d, "train_cls")),
                                         None), timeout=120)
        cluster.scontrol("update", f"JobId={limited.job_id()}", "TimeLimit=10")  # its next sitting may finish
        return run_dir

    with ThreadPoolExecutor(1 + len(stops)) as pool:
        drivers = [pool.submit(run_into_the_time_limit), *(pool.submit(stop_in_turn, name) for name in stops)]
        limited_dir, *_ = (driver.result() for driver in drivers)

    outcomes = {name: sweep.finish() for name, sweep in sweeps.items()}
    for name, (code, out) in outcomes.items():
        if name not in ("failing", "cancelled"):
            assert code == 0, f"{name}: {out[-3000:]}"

    # the sweep: two runs, each complete
    runs = sweeps["sweep"].run_dirs()
    assert len(runs) == 2 and all(results(r)["completed"] for r in runs)
    assert sorted(results(r)["attn"] for r in runs) == ["mha", "moh"]

    # two tasks = one run of two processes, equal to torchrun's
    for name in ("ddp_cls", "ddp_dit"):
        (run_dir,) = sweeps[name].run_dirs()
        assert results(run_dir)["world_size"] == 2 and results(run_dir)["completed"] is True
        assert_same_weights(run_dir, finished(references[name]))
    # srun in a batch script: the same run
    assert cluster.wait_state(srun_job, "COMPLETED", "FAILED", timeout=240) == "COMPLETED", \
        (tmp_path / "srun.out").read_text()[-3000:]
    assert results(srun_dir)["world_size"] == 2
    assert_same_weights(srun_dir, references["ddp_cls"].folder)

    # every stop: requeued, resumed, and the same weights as the uninterrupted run
    (run_dir,) = sweeps["stops"].run_dirs()
    log = _log(run_dir, "train_cls")
    assert all(f"received {name}" in log for name in ("SIGUSR2", "SIGUSR1", "SIGTERM")), log[-3000:]
    assert log.count("resumed from") == len(stops["stops"]) and results(run_dir)["completed"] is True
    assert_same_weights(run_dir, finished(references["stop"]))
    assert "this job is timed-out" in _log(limited_dir, "train_cls")  # SLURM's signal; submitit counted a time-out
    assert "resumed from" in _log(limited_dir, "train_cls") and results(limited_dir)["completed"] is True
    assert_same_weights(limited_dir, finished(references["stop"]))

    # scancel without --signal cancels: the state is saved, the job is not requeued, the sweep says so
    code, out = outcomes["cancelled"]
    (run_dir,) = sweeps["cancelled"].run_dirs()
    assert code != 0 and "not requeued: SLURM is ending the job (JobState=COMPLETING" in out, out[-2000:]
    assert results(run_dir)["preempted"] is True and latest_checkpoint(run_dir) is not None
    assert "resumed from" not in _log(run_dir, "train_cls")

    # a failing job fails its sweep, and its run's log says why
    code, out = outcomes["failing"]
    assert code != 0
    (run_dir,) = sweeps["failing"].run_dirs()
    assert "train.batch_size=129" in _log(run_dir, "train_cls")


# ------------------------------------------------------------------ two nodes

NODE_CPUS = 4


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    why = unavailable(nodes=2)
    if why:
        pytest.skip(why)
    with SlurmCluster(tmp_path_factory.mktemp("slurm2"), nodes=2, cpus=NODE_CPUS) as up:
        yield up


def test_a_two_node_job_is_one_run(two_nodes, references, tmp_path):
    """One task per node, rendezvous at the first node: one run dir, the lock never taken over from the
    other node's task, the weights of torchrun with two processes."""
    sweep = Sweep(two_nodes, tmp_path / "sweep", "train_cls.py", *CLS, "train.epochs=2", "hydra.launcher.nodes=2")
    code, out = sweep.finish()
    assert code == 0, out[-3000:]
    (run_dir,) = sweep.run_dirs()
    assert results(run_dir)["world_size"] == 2
    assert "taking over" not in _log(run_dir, "train_cls")
    assert_same_weights(run_dir, finished(references["ddp_cls"]))


def test_a_preempted_job_is_requeued_and_finishes_bit_identical(two_nodes, references, tmp_path):
    """A job of the low-priority partition (debug) holding a node's CPUs is preempted (REQUEUE) by a job
    of the urgent partition on that node; it comes back and ends as the uninterrupted run."""
    victim = Sweep(two_nodes, tmp_path / "victim", "train_cls.py", *CLS, STOP_EPOCHS, "hydra.launcher.partition=debug",
                   f"hydra.launcher.cpus_per_task={NODE_CPUS}")
    paused = victim.pause_when_training()  # SLURM's SIGCONT + SIGTERM of the preemption wakes it
    node = two_nodes.job_field(victim.job_id(), "NodeList")
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-c", str(NODE_CPUS), "-w", node,
                             "-o", str(tmp_path / "urgent.out"), "--wrap", "sleep 1"],
                            env=two_nodes.env, capture_output=True, text=True, check=True)
    paused.resume_when_signalled(signal.SIGTERM, timeout=120)
    assert two_nodes.wait_state(urgent.stdout.strip(), "COMPLETED", timeout=120) == "COMPLETED"
    code, out = victim.finish()
    assert code == 0, out[-3000:]
    (run_dir,) = victim.run_dirs()
    assert "resumed from" in _log(run_dir, "train_cls")
    assert_same_weights(run_dir, finished(references["stop"]))


def _seconds(run_time: str) -> int:
    """SLURM's [D-][HH:]MM:SS in seconds."""
    days, _, clock = run_time.rpartition("-")
    seconds = 0
    for part in clock.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds + int(days or 0) * 86400


def _signal(cluster: SlurmCluster, command: list[str], job_id: str) -> None:
    done = subprocess.run([*command, job_id], env=cluster.env, capture_output=True, text=True)
    assert done.returncode == 0, f"{command} {job_id}: {done.stderr} (job {cluster.job_state(job_id)})"


def _log(run_dir: Path, name: str) -> str:
    path = run_dir / f"{name}.log"
    return path.read_text() if path.is_file() else ""


def _wait_for(find, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = find()
        if found is not None:
            return found
        time.sleep(0.2)
    raise TimeoutError("the awaited file did not appear")
