"""What a process needs to know and do under SLURM, whoever started it (``srun``, submitit's pickled
job, an ``sbatch`` script): its place in the job step, the requeue after a stop, and whether a
request can ever be scheduled.

    export_task_env()          # torchrun's variables from SLURM's, in a task of a multi-task step
    request_requeue(signum)    # rank 0, after the checkpoint: put the job back in the queue
    check_schedulable(...)     # before submission: refuse what no node of the partition can run

torchrun's environment contract (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) is the one interface the rest of the engine reads, so a SLURM step of N tasks forms
the same process group as ``torchrun --nproc_per_node=N``.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def in_slurm_job(environ: Mapping[str, str] = os.environ) -> bool:
    return "SLURM_JOB_ID" in environ


def job_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The id ``scontrol requeue`` takes: ``ARRAYJOB_TASK`` for an element of a job array."""
    if "SLURM_ARRAY_JOB_ID" in environ and "SLURM_ARRAY_TASK_ID" in environ:
        return f"{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    return environ.get("SLURM_JOB_ID")


def step_tasks(environ: Mapping[str, str] = os.environ) -> int:
    """Tasks of this job step; 1 outside a step (e.g. in the batch script itself, where SLURM_NTASKS
    counts the job's tasks, not the processes running this program)."""
    if "SLURM_STEP_ID" not in environ:
        return 1
    return int(environ.get("SLURM_STEP_NUM_TASKS", "1") or 1)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[07-08,11],cpu01`` -> ``gpu07``."""
    head = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist.strip())
    if head is None or not head.group(0):
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges, suffix = head.groups()
    return prefix + (re.split(r"[,-]", ranges)[0] if ranges else "") + suffix


def rendezvous_port(job: str) -> int:
    """A port every task of a job derives alike from its id (20000-59999), so concurrent jobs on one
    node rarely collide; ``MASTER_PORT`` set by the user wins."""
    return 20000 + int(re.sub(r"\D", "", job) or 0) % 40000


def export_task_env(environ: dict[str, str] | None = None) -> bool:
    """In a task of a multi-task SLURM step not started by torchrun: set torchrun's variables from
    SLURM's (rendezvous at the first host of the job's node list, a port derived from the job id).
    True when it set them. Call before anything reads RANK (Hydra's run dir, the process group)."""
    environ = os.environ if environ is None else environ
    if "RANK" in environ or step_tasks(environ) < 2:
        return False
    world = step_tasks(environ)
    nodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_JOB_NUM_NODES") or 1)
    environ.update({
        "RANK": environ["SLURM_PROCID"], "WORLD_SIZE": str(world), "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": str(max(world // max(nodes, 1), 1)),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(
            environ.get("SLURM_STEP_NODELIST") or environ["SLURM_JOB_NODELIST"]),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(rendezvous_port(environ["SLURM_JOB_ID"])),
    })
    log.debug("SLURM task %s of %s, rendezvous %s:%s", environ["RANK"], world, environ["MASTER_ADDR"],
              environ["MASTER_PORT"])
    return True


def _submitit_handler(handlers: Iterable[Any]):
    """submitit's signal handler object among ``handlers`` (the signal handlers that were installed
    before ours), or None outside submitit."""
    for handler in handlers:
        owner = getattr(handler, "__self__", None)
        if hasattr(owner, "checkpoint_and_try_requeue"):
            return owner
    return None


def request_requeue(signum: int, previous_handlers: Iterable[Any] = ()) -> str | None:
    """Put this SLURM job back in the queue after a stop (call on rank 0, once the checkpoint is
    saved). Under submitit (its handler among ``previous_handlers``) its protocol decides: the
    re-submission pickle, ``max_num_timeout`` counted on time-outs; otherwise ``scontrol requeue``.
    A job SLURM is requeueing already (preemption, ``scontrol requeue``) needs nothing; a job SLURM is
    ending (``scancel`` without ``--signal``, the time limit reached) is left to end. Returns None
    when the job is requeued, else why not."""
    jid = job_id()
    if jid is None:
        return "not a SLURM job"
    state = _job_state(jid)
    if _requeued(*state):
        return None
    if state[0] != "RUNNING":
        return f"SLURM is ending the job (JobState={state[0]}: cancelled with scancel, or past its time limit)"
    handler = _submitit_handler(previous_handlers)
    if handler is not None:
        try:
            handler.checkpoint_and_try_requeue(signum)
        except SystemExit:  # submitit requeued the job and exits; we exit ourselves, after the other ranks
            return None
        except subprocess.CalledProcessError as err:  # SLURM may have begun a requeue meanwhile
            return None if _requeued(*_job_state(jid)) else f"scontrol requeue {jid} failed ({err})"
        except Exception as err:  # submitit's UncompletedJobError: e.g. timed out too many times
            return str(err)
        return "submitit did not requeue the job"
    result = subprocess.run(["scontrol", "requeue", jid], capture_output=True, text=True, timeout=60)
    if result.returncode == 0 or _requeued(*_job_state(jid)):
        return None
    return f"scontrol requeue {jid} failed: {result.stderr.strip() or result.returncode}"


def _requeued(state: str, restarts: int) -> bool:
    """Whether SLURM is requeueing this job already: its restart count is past this instance's."""
    return restarts > int(os.environ.get("SLURM_RESTART_COUNT") or 0) or state in (
        "PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD")


def _job_state(jid: str) -> tuple[str, int]:
    """The job's state and restart count as the controller has them now. After a requeue the restart
    count is past this instance's (SLURM_RESTART_COUNT) at once, while the state may still read
    COMPLETING; a cancelled job reads COMPLETING with the same count."""
    out = subprocess.run(["scontrol", "-o", "show", "job", jid], capture_output=True, text=True, timeout=60).stdout
    state = re.search(r"\bJobState=(\S+)", out)
    restarts = re.search(r"\bRestarts=(\d+)", out)
    return (state.group(1) if state else "UNKNOWN"), (int(restarts.group(1)) if restarts else 0)


# ---------------------------------------------------------------- scheduling
@dataclass(frozen=True)
class NodeCapacity:
    name: str
    cpus: int
    memory_mb: int
    gpus: int


@dataclass(frozen=True)
class Request:
    """What one node of the job must offer."""

    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    mem_gb: float | None
    gpus_per_node: int

    @property
    def cpus(self) -> int:
        return self.tasks_per_node * self.cpus_per_task


def partition_nodes(partition: str | None) -> list[NodeCapacity]:
    """Every node of ``partition`` (the default partition when None) with what it offers in all:
    CPUs, memory and GPUs (``gres`` gpu count), as ``sinfo`` reports them."""
    cmd = ["sinfo", "-h", "-N", "-o", "%N|%c|%m|%G|%P"]
    if partition:
        cmd += ["-p", partition]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"sinfo failed ({out.stderr.strip()}); is SLURM reachable from this machine?")
    nodes: dict[str, NodeCapacity] = {}
    for line in out.stdout.splitlines():
        name, cpus, memory, gres, part = line.split("|")
        if partition is None and not part.endswith("*"):
            continue
        gpus = sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[^:,()]+)?:(\d+)", gres))
        nodes[name] = NodeCapacity(name, int(cpus), int(re.sub(r"\D", "", memory) or 0), gpus)
    return list(nodes.values())


def check_schedulable(request: Request, partition: str | None, nodes: list[NodeCapacity] | None = None) -> None:
    """ValueError when no ``request.nodes`` nodes of the partition can ever hold the request (a
    job SLURM would leave pending for ever, or refuse only after submission), naming what was asked
    and what the largest node offers."""
    nodes = partition_nodes(partition) if nodes is None else nodes
    where = f"partition {partition}" if partition else "the default partition"
    if not nodes:
        raise ValueError(f"{where} has no nodes (sinfo lists none); set hydra.launcher.partition to one that has")
    fitting = [n for n in nodes if n.cpus >= request.cpus and n.gpus >= request.gpus_per_node
               and (request.mem_gb is None or n.memory_mb >= request.mem_gb * 1024)]
    if len(fitting) >= request.nodes:
        return
    best = max(nodes, key=lambda n: (n.gpus, n.cpus, n.memory_mb))
    asked = (f"{request.nodes} node(s) each with {request.tasks_per_node} tasks x {request.cpus_per_task} CPUs "
             f"= {request.cpus} CPUs, {request.gpus_per_node} GPUs, "
             f"{'no memory limit' if request.mem_gb is None else f'{request.mem_gb:g} GB'}")
    raise ValueError(
        f"no {request.nodes} node(s) of {where} can ever run this job: asked for {asked}; "
        f"{len(fitting)} of its {len(nodes)} node(s) fit, the largest ({best.name}) has {best.cpus} CPUs, "
        f"{best.gpus} GPUs and {best.memory_mb / 1024:.0f} GB. Use the preset that fits the machine "
        "(hydra/launcher=slurm_cpu on CPU nodes, hydra/launcher=slurm on GPU nodes) or lower "
        "hydra.launcher.tasks_per_node / cpus_per_task / gpus_per_node / mem_gb / nodes"
    )
