"""Test-session set-up. `make test` runs two xdist workers on our two cores: one torch thread per
worker avoids oversubscription, which slows small CPU kernels by an order of magnitude."""

import torch


def pytest_configure(config):
    torch.set_num_threads(1)
