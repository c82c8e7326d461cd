"""Describe a machine (the one a run, study or benchmark ran on): CPU model, core count, torch version, GPU if any."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def describe_machine() -> dict[str, str | int]:
    """A JSON-able description of this machine."""
    info: dict[str, str | int] = {
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_line(info: dict[str, str | int]) -> str:
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ", no GPU"
    return f"{info.get('cpu', '?')} ({info.get('cores', '?')} usable cores){gpu}; torch {info.get('torch', '?')}"
