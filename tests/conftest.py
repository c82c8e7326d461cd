"""Test-session set-up. `make test` runs two xdist workers on our two cores: one torch thread per
worker avoids oversubscription, which slows small CPU kernels by an order of magnitude."""

import os
import signal

import pytest
import torch

# Without a GPU, Triton kernels (visattn.kernels.cuda_routing) run in Triton's interpreter on CPU tensors. The
# switch is read when triton is imported (its own library functions are jitted then), so it is set here, before
# any test module imports it (torch alone does not).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The SLURM cluster tests first: their jobs mostly wait on the scheduler, so started at once on one
    worker (one file: ``--dist loadfile``) they run beside the rest of the suite instead of after it."""
    items.sort(key=lambda item: item.get_closest_marker("slurm") is None)  # stable: the rest keep their order


@pytest.fixture
def signal_at_step(monkeypatch):
    """``signal_at_step(module, n, signum)``: the n-th training step of a loop in ``module`` (its n-th
    call of ``clip_and_norm``, once per step) sends ``signum`` to this process, as a scheduler would."""

    def install(module, n: int, signum: int = signal.SIGTERM) -> None:
        real, calls = module.clip_and_norm, []

        def signalling(params, clip):
            calls.append(1)
            if len(calls) == n:
                os.kill(os.getpid(), signum)
            return real(params, clip)

        monkeypatch.setattr(module, "clip_and_norm", signalling)

    return install
