"""The cluster path on a real two-node SLURM: two slurmd nodes emulated on the one machine, each in
its own network namespace with its own address and host name (``slurm_cluster``). A multi-node job
(its rendezvous across the nodes) and preemption. Beside tests/test_slurm.py, with a cluster (and a
munged) of its own, so that the two files run side by side. Skipped, saying why, where SLURM or
network namespaces cannot be brought up."""

import signal
import subprocess

import pytest
from slurm_cluster import SlurmCluster, unavailable
from test_slurm import (
    CLS,
    STOP_EPOCHS,
    Sweep,
    _log,
    assert_same_weights,
    cleanup,
    direct_run,
    finished,
    results,
)

__all__ = ["cleanup"]  # the autouse fixture that ends a failed test's -m processes
pytestmark = pytest.mark.slurm
NODE_CPUS = 4


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    why = unavailable(nodes=2)
    if why:
        pytest.skip(why)
    with SlurmCluster(tmp_path_factory.mktemp("slurm2"), nodes=2, cpus=NODE_CPUS) as up:
        yield up


@pytest.fixture(scope="module")
def references(two_nodes, tmp_path_factory):
    folder = tmp_path_factory.mktemp("references")
    return {"ddp_cls": direct_run(two_nodes, folder / "ddp_cls", "train_cls.py", *CLS, "train.epochs=2", ranks=2),
            "stop": direct_run(two_nodes, folder / "stop", "train_cls.py", *CLS, STOP_EPOCHS)}


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
