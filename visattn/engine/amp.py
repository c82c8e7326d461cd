"""``train.amp``: bf16 autocast or none, the same vocabulary for both tasks.

    auto  bf16 on CUDA devices that support it; on CPU only when start-up probes find bf16
          faster: first a bf16 vs fp32 matmul (a few ms, cached per process; AVX2 CPUs emulate
          bf16, ~20x slower, and stop here with fp32), then, on CPUs with native bf16 (AMX /
          AVX512-BF16), a few steps of the run's own model (``StepProbe``). The model probe is
          needed: small models lose to autocast's casts even where matmuls win (the study's
          0.5 M-parameter DiT trained 2.3x slower in bf16 on an AVX512-BF16 EPYC whose 256x256
          matmul ran 1.9x faster).
          A resumed run keeps the choice its first process made (saved in the checkpoint): near
          the margin the probes could decide the other way, and one run would train in two
          precisions.
    bf16  always bf16 autocast.    none  fp32.
No fp16: it needs loss scaling, and bf16 is what the GPUs we target run. The old spellings
``true`` / ``false`` are accepted with a warning naming the new values.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .distributed import broadcast_object

log = logging.getLogger(__name__)

AMP_SETTINGS = ("auto", "bf16", "none")
BF16_MARGIN = 1.25  # auto picks bf16 on CPU only when its probes find bf16 at least this much faster
_LEGACY = {True: "bf16", False: "none", "true": "bf16", "false": "none", "True": "bf16", "False": "none"}


def sampling_amp(setting: str, device: torch.device | str) -> str:
    """``sample.amp`` -> the precision of the model's forwards while sampling, ``bf16`` or ``none``.
    ``auto``: bf16 on a CUDA device that has it (the sampling steps are the model's forwards, and
    bf16 runs them at the GPU's speed); fp32 elsewhere, so a CPU run's samples are the same on every
    CPU kind (no probe: a timing-dependent choice would make two evaluations of one checkpoint
    differ). The diffusion's own arithmetic stays fp32 either way."""
    setting = normalize_amp(setting, "sample.amp")
    if setting != "auto":
        return setting
    device = torch.device(device)
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "none"


def normalize_amp(value: Any, key: str = "train.amp") -> str:
    """``value`` as one of AMP_SETTINGS (legacy booleans mapped, with a warning)."""
    if isinstance(value, str) and value in AMP_SETTINGS:
        return value
    if value in _LEGACY:
        new = _LEGACY[value]
        log.warning("%s=%s is deprecated; write %s=%s (values: %s)", key, value, key, new, "|".join(AMP_SETTINGS))
        return new
    raise ValueError(f"{key}={value!r} is not known; use one of {'|'.join(AMP_SETTINGS)}")


@functools.cache
def cpu_bf16_is_faster(size: int = 256, repeats: int = 3) -> bool:
    """Time a [size, size] matmul in bf16 and fp32 on this CPU (best of ``repeats``); cached."""
    a32 = torch.randn(size, size, generator=torch.Generator().manual_seed(0))
    a16 = a32.to(torch.bfloat16)

    def best(x: torch.Tensor, give_up_after: float = float("inf")) -> float:
        times = []
        for _ in range(repeats + 1):  # the first run is a warm-up, unless it already decides
            t0 = time.perf_counter()
            x @ x
            times.append(time.perf_counter() - t0)
            if times[-1] > give_up_after:  # clearly slower (emulated bf16): do not wait for more runs
                return times[-1]
        return min(times[1:])

    t32 = best(a32)
    t16 = best(a16, give_up_after=10 * t32 + 1e-3)
    log.info("bf16 probe on CPU: fp32 %.2f ms, bf16 %.2f ms per %dx%d matmul", 1e3 * t32, 1e3 * t16, size, size)
    # Only a clear win counts: near a tie the probe's noise would flip the choice between two runs
    # of one config on one machine (seen with 16 threads on a native-bf16 CPU).
    return t16 * BF16_MARGIN < t32


@dataclass(frozen=True)
class StepProbe:
    """One step of the run's real work for ``auto`` to time in fp32 and in bf16: ``loss()`` runs a
    forward pass of ``model`` on a batch of the run's shapes to a scalar; with ``backward`` the
    step includes the backward pass (training), without it runs under ``torch.inference_mode``
    (evaluation). The probe leaves no trace: gradients are cleared and torch's CPU RNG restored."""

    model: nn.Module
    loss: Callable[[], torch.Tensor]
    backward: bool = True
    repeats: int = 2

    def compare(self, give_up_ratio: float = 10.0) -> tuple[float, float]:
        """Seconds of one fp32 and one bf16 step: the best of ``repeats`` after a warm-up of each,
        timed alternately (fp32, bf16, fp32, ...) so that other work on the machine slows both
        alike instead of the one timed while it ran. Stops after the warm-ups when bf16's took over
        ``give_up_ratio`` times fp32's (emulated bf16: no need to wait)."""
        t32: list[float] = []
        t16: list[float] = []
        with torch.random.fork_rng(devices=[]):
            for _ in range(self.repeats + 1):
                t32.append(self._timed(None))
                t16.append(self._timed(torch.bfloat16))
                if len(t16) == 1 and t16[0] > give_up_ratio * t32[0]:
                    return t32[0], t16[0]
        return min(t32[1:]), min(t16[1:])

    def _timed(self, dtype: torch.dtype | None) -> float:
        t0 = time.perf_counter()
        self._step(dtype)
        return time.perf_counter() - t0

    def _step(self, dtype: torch.dtype | None) -> None:
        autocast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
        if not self.backward:
            with torch.inference_mode(), autocast:
                self.loss()
            return
        with autocast:
            loss = self.loss()
        loss.backward()
        self.model.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class AmpChoice:
    dtype: torch.dtype | None
    reason: str

    @property
    def name(self) -> str:
        return "bf16" if self.dtype is not None else "none"

    def autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=self.dtype) if self.dtype else contextlib.nullcontext()

    def record(self) -> dict[str, str]:
        """results.json fields (and what a checkpoint keeps for ``choose_amp(saved=...)``)."""
        return {"amp": self.name, "amp_reason": self.reason}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> AmpChoice:
        name = record.get("amp")
        if name not in ("bf16", "none"):
            raise ValueError(f"a saved mixed-precision choice must be amp=bf16|none, not {name!r} (in {dict(record)})")
        return cls(torch.bfloat16 if name == "bf16" else None, str(record.get("amp_reason", "")))


def _cpu_auto(probe: StepProbe | None) -> AmpChoice:
    if not cpu_bf16_is_faster():
        return AmpChoice(None, "auto: bf16 matmul measured slower than fp32 on this CPU")
    if probe is None:
        return AmpChoice(torch.bfloat16, "auto: bf16 matmul measured faster than fp32 on this CPU")
    t32, t16 = probe.compare()
    faster = t16 * BF16_MARGIN < t32
    what = "training step" if probe.backward else "forward pass"
    return AmpChoice(torch.bfloat16 if faster else None,
                     f"auto: this model's {what} measured {1e3 * t16:.0f} ms in bf16 vs {1e3 * t32:.0f} ms "
                     f"in fp32 on this CPU (bf16 only when >= {BF16_MARGIN}x faster)")


def choose_amp(setting: Any, device: torch.device, probe: StepProbe | None = None,
               saved: Mapping[str, Any] | None = None) -> AmpChoice:
    """The autocast dtype for ``train.amp`` on ``device``; the decision is logged. Under
    ``auto``, ``saved`` (the ``record()`` of a resumed run's checkpoint, None for a fresh run)
    decides without probing; else on CPU ``probe`` (the run's model at its own shapes) settles
    it where the matmul probe favours bf16, and without one the matmul decides. Every rank takes
    rank 0's decision."""
    setting = normalize_amp(setting)
    if setting == "bf16":
        choice = AmpChoice(torch.bfloat16, "train.amp=bf16")
    elif setting == "none":
        choice = AmpChoice(None, "train.amp=none")
    elif saved is not None and "amp" in saved:
        choice = AmpChoice.from_record(saved)
        log.info("mixed precision: %s, as chosen when the run started (%s)", choice.name, choice.reason)
        return choice
    elif device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        choice = AmpChoice(torch.bfloat16 if ok else None,
                           f"auto: this CUDA device {'supports' if ok else 'lacks'} bf16")
    elif device.type == "cpu":
        choice = broadcast_object(_cpu_auto(probe))
    else:
        choice = AmpChoice(None, f"auto: no bf16 policy for device type {device.type}")
    log.info("mixed precision: %s (%s)", choice.name, choice.reason)
    return choice


def apply_tf32(enabled: bool, device: torch.device | str) -> bool:
    """``train.tf32``: on a CUDA device, let fp32 matmuls (cuBLAS) and cuDNN convolutions run in TF32, as
    DiT's and timm's training scripts do (the fp32 work of a ``train.amp=none`` run, of the EMA
    model and of the metrics' feature extractor; ~10 mantissa bits instead of 23, at several times
    the speed on Ampere and later), or keep both in full fp32 (``false``). Other devices are left as
    they are. Returns whether TF32 is on for this run (results.json's ``tf32``)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"train.tf32={enabled!r} must be true or false")
    if torch.device(device).type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    log.info("TF32 for fp32 matmuls and convolutions: %s (train.tf32)", "on" if enabled else "off")
    return enabled
