"""visattn's SLURM launcher for Hydra (``hydra/launcher=slurm`` / ``slurm_cpu``), found by Hydra's plugin scan."""

from .launcher import VisattnSlurmLauncher, VisattnSlurmQueueConf

__all__ = ["VisattnSlurmLauncher", "VisattnSlurmQueueConf"]
