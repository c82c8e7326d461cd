"""hydra-submitit-launcher's SLURM launcher, with what a multi-task job and a cluster user need:

- each job process sets up as ``python train_*.py`` does before Hydra runs (torchrun's variables from
  SLURM's, our resolvers): submitit runs the pickled task function, not the script's ``__main__``
  block, so without this every task of an N-task job trained alone;
- a failed task fails its job (the task exits non-zero and ``srun --kill-on-bad-exit`` stops its
  peers) and so the sweep; the error is in the run's log (the entry points log it) and not only in
  submitit's result pickle;
- a request that no node of the partition can ever satisfy is refused before submission, with the
  numbers, instead of pending for ever while the ``-m`` process waits.

The configs are conf/hydra/launcher/slurm.yaml (GPU nodes) and slurm_cpu.yaml (CPU nodes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher


@dataclass
class VisattnSlurmQueueConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.visattn_slurm.launcher.VisattnSlurmLauncher"
    # extra arguments of the srun that starts the tasks; a task that fails stops the others at once
    srun_args: list[str] = field(default_factory=lambda: ["--kill-on-bad-exit=1"])
    check_resources: bool = True  # refuse, before submission, a request no node of the partition can hold


ConfigStore.instance().store(group="hydra/launcher", name="visattn_slurm", node=VisattnSlurmQueueConf,
                             provider="visattn")


class VisattnSlurmLauncher(SlurmLauncher):
    def __init__(self, check_resources: bool = True, **params: Any) -> None:
        super().__init__(**params)  # every other key goes to submitit's executor
        self.check_resources = check_resources

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        from visattn.engine.launch import prepare_process

        prepare_process()
        ret = super().__call__(*args, **kwargs)
        if ret.status == JobStatus.FAILED:  # exit non-zero: srun stops the other tasks, the sweep fails
            raise ret._return_value
        return ret

    def launch(self, job_overrides, initial_job_idx):
        if self.check_resources:
            self._check_resources()
        return super().launch(job_overrides, initial_job_idx)

    def _check_resources(self) -> None:
        from visattn.engine.slurm import Request, check_schedulable

        p = self.params
        gres_gpus = sum(int(part.rsplit(":", 1)[1]) for part in str(p.get("gres") or "").split(",")
                        if part.startswith("gpu") and part.rsplit(":", 1)[-1].isdigit())
        request = Request(nodes=int(p.get("nodes") or 1), tasks_per_node=int(p.get("tasks_per_node") or 1),
                          cpus_per_task=int(p.get("cpus_per_task") or 1), mem_gb=p.get("mem_gb"),
                          gpus_per_node=int(p.get("gpus_per_node") or 0) or gres_gpus)
        check_schedulable(request, p.get("partition"))
