"""Describe a machine (the one a run, study or benchmark ran on): CPU model and vector ISA, native bf16,
core count, torch version, GPU if any."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def _cpuinfo(key: str) -> str | None:
    """The first ``key`` entry of /proc/cpuinfo (Linux), None elsewhere or when absent."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "unknown CPU"


def cpu_isa() -> str:
    """The vector instruction set torch's CPU kernels use here (e.g. AVX2, AVX512)."""
    return torch.backends.cpu.get_cpu_capability()


def native_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX-512 BF16 or AMX); without it bf16 is emulated,
    ~20x slower than fp32."""
    flags = set((_cpuinfo("flags") or "").split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def describe_machine() -> dict[str, str | int | bool]:
    """A JSON-able description of this machine."""
    info: dict[str, str | int | bool] = {
        "cpu": cpu_model(),
        "cpu_isa": cpu_isa(),
        "native_bf16": native_bf16(),
        "cores": usable_cores(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_line(info: dict[str, str | int | bool]) -> str:
    """One line naming the machine; two CPUs with one model name but different vector units (an AVX2
    and an AVX-512 EPYC) get different lines. Descriptions written before ``cpu_isa`` was recorded
    leave it out."""
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ", no GPU"
    isa = ""
    if info.get("cpu_isa"):
        isa = f", {info['cpu_isa']}, {'native' if info.get('native_bf16') else 'no native'} bf16"
    return f"{info.get('cpu', '?')}{isa} ({info.get('cores', '?')} usable cores){gpu}; torch {info.get('torch', '?')}"
