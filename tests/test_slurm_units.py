"""The SLURM facts the launch layer derives without a cluster: a task's place in its job step, and
whether a request can ever be scheduled (the cluster itself: tests/test_slurm.py)."""

import pytest

from visattn.engine.slurm import NodeCapacity, Request, check_schedulable, export_task_env, first_host

TASK = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1", "SLURMD_NODENAME": "gpu08"}


def test_a_task_of_a_multi_task_step_gets_torchruns_variables():
    environ = dict(TASK)
    assert export_task_env(environ) is True
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"], environ["LOCAL_WORLD_SIZE"]) == (
        "3", "4", "1", "2")
    assert environ["MASTER_ADDR"] == "gpu07"  # the first host of the job's node list
    assert environ["MASTER_PORT"] == str(20000 + 77)  # every task of the job derives the same port
    mine = {**TASK, "MASTER_PORT": "29500"}
    export_task_env(mine)
    assert mine["MASTER_PORT"] == "29500"  # the user's wins


@pytest.mark.parametrize("nodelist, first", [("gpu[07-08]", "gpu07"), ("node1", "node1"), ("a[3,5-6],b1", "a3"),
                                             ("rack1-n[010-012]-ib", "rack1-n010-ib"), ("x[4]", "x4")])
def test_the_rendezvous_host_is_the_first_of_the_node_list(nodelist, first):
    assert first_host(nodelist) == first


@pytest.mark.parametrize("drop, extra", [("SLURM_STEP_ID", {}), (None, {"SLURM_STEP_NUM_TASKS": "1"}),
                                         (None, {"RANK": "0"})])
def test_one_process_is_left_alone(drop, extra):
    """The batch script itself (no step: SLURM_NTASKS counts the job's tasks, not this program's
    processes), a one-task step, or a process torchrun started: nothing to derive."""
    environ = {**TASK, **extra}
    environ.pop(drop, None)
    before = dict(environ)
    assert export_task_env(environ) is False and environ == before


NODES = [NodeCapacity("cpu01", 64, 256_000, 0), NodeCapacity("gpu01", 96, 1_000_000, 8)]


def test_a_request_that_fits_a_node_passes():
    check_schedulable(Request(1, 8, 10, 480, 8), "p", NODES)
    check_schedulable(Request(2, 1, 32, None, 0), "p", NODES)


@pytest.mark.parametrize("request_, fragment", [
    (Request(1, 8, 10, 480, 8), None),
    (Request(1, 8, 16, None, 8), "8 tasks x 16 CPUs = 128 CPUs, 8 GPUs, no memory limit; 0 of its 2 node(s) fit"),
    (Request(3, 1, 2, None, 0), "no 3 node(s) of partition p"),
    (Request(1, 1, 2, 2000, 0), "2000 GB; 0 of its 2 node(s) fit, the largest (gpu01) has 96 CPUs, 8 GPUs and 977 GB"),
])
def test_a_request_no_node_can_hold_is_refused_with_the_numbers(request_, fragment):
    if fragment is None:
        check_schedulable(request_, "p", NODES)
        return
    with pytest.raises(ValueError) as refused:
        check_schedulable(request_, "p", NODES)
    assert fragment in str(refused.value) and "hydra/launcher=slurm_cpu" in str(refused.value)
