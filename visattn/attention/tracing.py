"""Whether a forward runs on real values: under torch.fx symbolic tracing every tensor is a Proxy,
and a per-forward statistic recorded then (``stats``, a router's ``head_load``) would leave a Proxy
on the module until the next eager forward. Also: whether autocast is on for a device."""

import functools

import torch

try:  # torch >= 2.5: true under fx.symbolic_trace only (is_fx_tracing is also true under torch.export)
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing as _is_symbolic_tracing
except ImportError:
    from torch.fx._symbolic_trace import is_fx_tracing as _is_symbolic_tracing


@torch.jit.unused
def _fx_tracing() -> bool:
    return _is_symbolic_tracing()


def keeps_stats() -> bool:
    """False while torch.fx traces (scripted code and torch.compile keep their statistics)."""
    if torch.jit.is_scripting():
        return True
    return not _fx_tracing()


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)``, False for a device without autocast (meta tensors: deferred
    initialisation, shape checks), where torch's own query raises."""
    return _autocast_available(device_type) and torch.is_autocast_enabled(device_type)


@functools.cache
def _autocast_available(device_type: str) -> bool:
    """A property of the torch build, asked on every MoH forward: cached, as torch's query costs ~0.7 us."""
    return torch.amp.is_autocast_available(device_type)
