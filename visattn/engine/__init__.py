"""Machinery shared by the tasks: launch, checkpoints, DDP, EMA, the non-finite guard, preemption,
SLURM, run logs and results. Each task's set-up, data, loop and evaluation live in its own package,
``engine.cls`` and ``engine.dit``; the modules here never import them."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# The flat task modules of earlier releases, now in the task packages. Their old names still import
# (the same module object, so monkeypatching either name patches both) with a DeprecationWarning.
MOVED = {
    "cls_setup": "cls.setup", "cls_eval": "cls.evaluation", "cls_trainer": "cls.trainer",
    "dit_setup": "dit.setup", "dit_data": "dit.data", "dit_eval": "dit.evaluation",
    "dit_sampling": "dit.sampling", "dit_latents": "dit.latents", "dit_train": "dit.training",
    "dit_trainer": "dit.trainer",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``visattn.engine.<old name>`` to the moved module."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new_name = f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}"
        warnings.warn(f"{spec.name} moved to {new_name}: import it from there", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new_name)

    def exec_module(self, module):
        # The import system has just set the moved module's __spec__ to the old name's; find its own again.
        package = sys.modules[module.__name__.rpartition(".")[0]]
        module.__spec__ = importlib.machinery.PathFinder.find_spec(module.__name__, package.__path__)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
