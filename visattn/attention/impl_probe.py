"""Choose the fastest exact path of a layer by timing them on the running machine (``impl="auto"``).

Which MoH path is fastest depends on the machine more than on the FLOPs: on a CPU with AMX the
dense matmuls are so fast that gathers and narrow per-head matmuls lose to the masked dense path at
every budget, while elsewhere skipping heads pays at large shapes. So ``auto`` measures instead of
predicting. The first eval forward of a layer at a new *probe key* times every path the layer has,
interleaved (round-robin, so load from other work slows all alike), and takes the fastest; the
choice is cached for the process (and, opted in, on disk), so later forwards pay a dict lookup.

Probe key: the device's name (CPU model and vector ISA, or the GPU's name), torch's intra-op
threads, the torch version, the compute dtype (the autocast dtype under autocast), the input shape
``[B, N, C]`` and the layer's signature (heads, key/value heads, head width, output width, shared
heads, routed_topk, routing, router kind), and which compiled kernels run, with their build (a new
version of them probes again). Identical layers of a model share one probe; a new shape
(e.g. the last, smaller batch) probes again.

Timing (``default_timer``: this thread's CPU time with one intra-op thread, wall time with several
or on CUDA): an untimed first call of each path (a JIT compile, lazy initialisation), one warm-up round
(paths other than the reference slower than ``give_up`` times the fastest warm-up stop there), then ``repeats``
timed rounds. The reference path (masked dense) is kept unless another path's time over
the reference's, round by round, has a median below ``1 - margin`` and that path was also faster in most
rounds (``pick_path``), so noise, and a machine whose speed drifts during the probe, cannot easily trade it
for a path that is really slower. Where a path wins, it, the reference and every other path that beat the
reference are timed for ``confirm`` rounds more and the pick is made again over all their rounds; where the
reference wins, so are it and every path within ``margin`` of it (a near miss). A probe costs about
(2 + repeats) forwards of each competitive path (and confirm more of the contenders of a close call), once per
key and process. It runs under ``torch.no_grad`` and outside any dispatch mode (e.g. the FLOP
counter), so it neither builds graphs nor counts as the model's work.

Disk cache (opt in with ``VISATTN_IMPL_CACHE=1``, or ``ImplProbe(disk_dir=...)``): one JSON file
per key under ``${VISATTN_CACHE:-~/.cache/visattn}/impl_choices/``. A choice made on a loaded
machine stays until the file is removed; the run record says where each choice came from.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from visattn.utils.ratios import median_ratio, round_ratios

log = logging.getLogger(__name__)

Timer = Callable[[str, Callable[[], object]], float]  # (path name, run) -> seconds of one run
DISK_ENV = "VISATTN_IMPL_CACHE"


@functools.cache
def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    name = None
    if cpuinfo.is_file():
        lines = cpuinfo.read_text(errors="replace").splitlines()
        name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)
    return f"{name or platform.processor() or platform.machine()} ({torch.backends.cpu.get_cpu_capability()})"


def device_name(device: torch.device | str) -> str:
    """The kind of processor a tensor on ``device`` runs on: the GPU's name, or the CPU's model and
    vector ISA (two CPUs sold under one name but with different vector units differ here)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return _cpu_name()
    return device.type


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def wall_timer(path: str, run: Callable[[], object]) -> float:
    """Seconds of one ``run()``, waiting for queued CUDA work at both ends."""
    sync = torch.cuda.synchronize if _cuda_in_use() else None
    if sync is not None:
        sync()
    start = time.perf_counter()
    run()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def default_timer(path: str, run: Callable[[], object]) -> float:
    """This thread's CPU seconds of one ``run()`` where torch computes on this thread alone (one
    intra-op thread, no CUDA): time spent waiting for a core taken by other work is not counted, so a
    loaded machine still compares the paths as an idle one would. Wall time otherwise (several
    threads: how well a path parallelises is part of its cost)."""
    if torch.get_num_threads() > 1 or _cuda_in_use():
        return wall_timer(path, run)
    start = time.thread_time()
    run()
    return time.thread_time() - start


@dataclass(frozen=True)
class PathChoice:
    """What ``auto`` chose for one probe key, and the evidence.

    ``source``: ``"probe"`` (timed now), ``"cache"`` (timed earlier in this process), ``"disk"``
    (timed by an earlier process), ``"fixed"`` (the layer's ``impl`` names the path) or ``"fallback"``
    (no probe possible: traced, fake or empty input). ``times_ms``: each path's best time; ``ratios``: each
    path's time over the reference's, the median over the probe's rounds (what ``pick_path`` decides by)."""

    path: str
    device: str
    source: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    times_ms: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """JSON-able fields for a run record."""
        out = asdict(self)
        out["shape"] = list(self.shape)
        return out

    def cached(self, source: str) -> PathChoice:
        return PathChoice(self.path, self.device, source, self.shape, self.dtype, dict(self.times_ms), dict(self.ratios))


def time_paths(
    runs: Mapping[str, Callable[[], object]], timer: Timer, repeats: int, give_up: float, keep: str | None = None,
    warm_up: bool = True,
) -> dict[str, list[float]]:
    """Seconds of each timed run per path: a first call of each (untimed: a JIT compile, lazy initialisation),
    one warm-up round, then ``repeats`` interleaved rounds for ``keep`` (the reference) and the paths whose
    warm-up took at most ``give_up`` times the fastest warm-up (the others keep their warm-up time as their only
    sample). The first call is not the warm-up: on a GPU the masked dense path's first call compiled the Triton
    gates (1.35 s against 1.4 ms), so it was given up and the probe took a path 4.5x slower (2026-11-27, H200).
    Each timed round takes the paths in a new order, drawn from a fixed seed, so a scripted timer gives a fixed
    result: in one fixed order a path always ran right after the same one, and right after a path that
    allocates much a layer ran up to 10% slower (``visattn.bench.timing.interleaved_times``), which would have
    counted against it. ``warm_up=False``: the rounds alone, of every path (paths that have just run)."""
    warm: dict[str, float] = {}
    timed = list(runs)
    if warm_up:
        for name, run in runs.items():
            timer(name, run)
        warm = {name: timer(name, run) for name, run in runs.items()}
        fastest = min(warm.values())
        timed = [name for name in runs if name == keep or warm[name] <= give_up * fastest]
    samples: dict[str, list[float]] = {name: [] for name in timed}
    rng = random.Random(0)
    for _ in range(repeats):
        rng.shuffle(timed)
        for name in timed:
            samples[name].append(timer(name, runs[name]))
    return {name: samples.get(name) or [warm[name]] for name in runs}


def paired_ratios(samples: Mapping[str, list[float]], reference: str) -> dict[str, float]:
    """Each path's time over ``reference``'s: the median over the rounds both were timed in of the round's ratio
    (``visattn.utils.ratios.median_ratio``); empty without the reference."""
    if reference not in samples:
        return {}
    return {name: median_ratio(times, samples[reference]) for name, times in samples.items()}


def pick_path(samples: Mapping[str, list[float]], reference: str, margin: float) -> str:
    """The first path, in order of its paired ratio to ``reference`` (the median over rounds of its time over
    the reference's in the same round), whose ratio is below ``1 - margin`` and which was faster than the
    reference in most of the rounds both were timed in; else ``reference``. Ties go to the earlier path.

    Paired, not best against best: a round's ratio cancels the machine's speed during that round. On a CPU
    whose speed drifted by +-30% within a run (AMD EPYC, 17th session) the best times of two paths came from
    different rounds, and the bench's ratio of two medians read MoH-75 at 1.204x `mha` where the paired ratio
    of the same samples read 1.062 (``visattn.bench.timing.paired_ratio``, which the benches report).

    Most rounds, not every one: with a single thread's CPU time the rounds still differ by a few percent, and
    requiring every round kept the masked dense path for layers whose kernel path was 9% faster (the study
    ViT's MoH-90 layers: 0.926x MHA's images/s instead of 0.97-0.98x). A burst of load that slows one path in
    one round is still outvoted, and one lucky round is not enough either: a median of two rounds is their
    mean, so a path needs the majority too. A path that fails the test does not hide the next one.

    Not by the best single round: a path whose time varies much can have the best round and still be slower
    most of the time. At DiT-B/2 with 11 of 12 heads, ``routed_kernel``'s best round beat
    ``routed_kernel_dense``'s by 1%, so it was taken, and it then ran 11% slower than it and 4% slower than
    masked dense (11th session)."""
    if reference not in samples:
        typical = {name: statistics.median(times) for name, times in samples.items()}
        return min(typical, key=lambda name: typical[name])
    # a path given up after the warm-up pairs its one sample with the reference's first
    ratios = {name: round_ratios(times, samples[reference]) for name, times in samples.items()}
    ratio = {name: statistics.median(r) for name, r in ratios.items()}  # paired_ratios, from the lists at hand
    for name in sorted(ratio, key=lambda name: ratio[name]):  # stable: ties keep the earlier path
        if name == reference:
            return reference
        wins = sum(r < 1 for r in ratios[name])
        if ratio[name] < 1 - margin and 2 * wins > len(ratios[name]):
            return name
    return reference


def default_disk_dir() -> Path | None:
    """Where probes keep their choices across processes: set by ``VISATTN_IMPL_CACHE`` (None: this process only)."""
    if os.environ.get(DISK_ENV, "").strip().lower() not in ("1", "true", "yes", "on"):
        return None
    return Path(os.environ.get("VISATTN_CACHE") or "~/.cache/visattn").expanduser() / "impl_choices"


class ImplProbe:
    """Times paths, picks one and remembers it per probe key (see the module docstring).

    Args:
        timer: ``(path name, run) -> seconds``; inject a scripted one to test decisions.
        repeats: timed rounds after the warm-up.
        margin: how much faster than the reference another path must be to replace it.
        give_up: paths whose warm-up took more than this times the fastest warm-up are not timed again.
        disk_dir: directory of the on-disk cache, or None for this process only.
        confirm: more rounds for a close call: where a path wins, the reference and every path that beat it are
            timed for this many rounds more, and the pick is made again over all their rounds; where the
            reference wins, it and every path within ``margin`` of it (0: never). On a 2-core AMD EPYC five rounds
            took, in one run of three, a path that was 4% slower than masked dense over 93 rounds (DiT-B/2 with 11
            of 12 heads; docs/benchmarks.md, 18th session), and in 3 of 14 probes ``routed_kernel_dense`` at
            0.87-0.91x masked dense where the bench read 1.00-1.02x, over the routed kernel's 0.93x (19th session).
            Resampled from 81 rounds of DiT-B/2 with 9 of 12 heads there, five rounds ranked those two paths
            wrongly 9% of the time, fifteen 0.5% (20th session).
    """

    def __init__(
        self,
        timer: Timer = default_timer,
        repeats: int = 5,
        margin: float = 0.02,
        give_up: float = 3.0,
        disk_dir: Path | str | None = None,
        confirm: int = 10,
    ) -> None:
        if repeats < 1:
            raise ValueError(f"repeats={repeats} must be >= 1 (timed rounds after the warm-up)")
        if confirm < 0:
            raise ValueError(f"confirm={confirm} must be >= 0 (rounds that recheck a close call; 0: none)")
        if not 0 <= margin < 1:
            raise ValueError(f"margin={margin} must be a fraction in [0, 1)")
        if give_up < 1:
            raise ValueError(f"give_up={give_up} must be >= 1 (a ratio to the fastest warm-up)")
        self.timer = timer
        self.repeats = repeats
        self.margin = margin
        self.give_up = give_up
        self.confirm = confirm
        self.disk_dir = Path(disk_dir).expanduser() if disk_dir is not None else None
        self.choices: dict[tuple, PathChoice] = {}

    def choose(
        self,
        key: tuple,
        runs: Mapping[str, Callable[[], object]],
        reference: str,
        shape: tuple[int, ...],
        dtype: str,
        device: str,
    ) -> PathChoice:
        """The path for ``key``: from this process's cache, the disk cache, or by timing ``runs``."""
        if key in self.choices:
            return self.choices[key].cached("cache")
        choice = self._load(key, runs)
        if choice is None:
            with torch.no_grad(), outside_dispatch_modes():
                samples = time_paths(runs, self.timer, self.repeats, self.give_up, keep=reference)
                path = pick_path(samples, reference, self.margin)
                contenders = self._contenders(samples, path, reference)
                if contenders:
                    group = {name: runs[name] for name in contenders}
                    more = time_paths(group, self.timer, self.confirm, give_up=float("inf"), warm_up=False)
                    samples = {**samples, **{name: samples[name] + more[name] for name in group}}
                    path = pick_path({name: samples[name] for name in group}, reference, self.margin)
            times = {name: round(1e3 * min(s), 4) for name, s in samples.items()}
            ratios = {name: round(r, 4) for name, r in paired_ratios(samples, reference).items()}
            choice = PathChoice(path, device, "probe", tuple(shape), dtype, times, ratios)
            log.info("impl=auto on %s for %s %s: %s (best ms: %s; time vs %s, median of the rounds: %s)", device, dtype,
                     list(shape), path, times, reference, ratios)
            self._save(key, choice)
        self.choices[key] = choice
        return choice

    def _contenders(self, samples: Mapping[str, list[float]], path: str, reference: str) -> list[str]:
        """The paths to time again, the reference first: where ``path`` won over ``reference``, every path that beat
        it in the median of the rounds; where the reference won, every path within ``margin`` of it (empty where
        none is, or with ``confirm`` 0). The near misses too: in a ViT-S run on a 2-core AMD EPYC, five rounds read
        ``routed_kernel`` at 1.001x masked dense for a layer with 5 of 6 heads, so masked dense was kept, where
        the bench's 21 rounds read 0.931x (docs/benchmarks.md, 28th session)."""
        if not self.confirm or reference not in samples:
            return []
        rounds = len(samples[reference])
        bound = 1.0 if path != reference else 1.0 + self.margin
        close = [name for name, times in samples.items()
                 if name != reference and len(times) == rounds and median_ratio(times, samples[reference]) < bound]
        return [reference, *close] if close else []

    def _file(self, key: tuple) -> Path | None:
        if self.disk_dir is None:
            return None
        return self.disk_dir / (hashlib.sha1(repr(key).encode()).hexdigest()[:20] + ".json")

    def _load(self, key: tuple, runs: Mapping[str, object]) -> PathChoice | None:
        file = self._file(key)
        if file is None or not file.is_file():
            return None
        try:
            data = json.loads(file.read_text())
            if data.get("key") != repr(key) or data["choice"]["path"] not in runs:
                return None
            fields = {**data["choice"], "shape": tuple(data["choice"]["shape"]), "source": "disk"}
            return PathChoice(**fields)
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("ignoring the unreadable impl choice %s (%s); probing again", file, err)
            return None

    def _save(self, key: tuple, choice: PathChoice) -> None:
        file = self._file(key)
        if file is None:
            return
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": repr(key), "choice": choice.record()}, indent=1))
            tmp.replace(file)
        except OSError as err:
            log.warning(
                "could not save the impl choice to %s (%s); it is kept for this process only", file, err
            )


_PROBE = ImplProbe(disk_dir=default_disk_dir())


def impl_probe() -> ImplProbe:
    """The probe ``impl="auto"`` layers use."""
    return _PROBE


@contextlib.contextmanager
def use_impl_probe(probe: ImplProbe) -> Iterator[ImplProbe]:
    """Make ``probe`` the one ``impl="auto"`` layers use inside the block (tests, benchmarks)."""
    global _PROBE
    previous, _PROBE = _PROBE, probe
    try:
        yield probe
    finally:
        _PROBE = previous


def outside_dispatch_modes():
    """A context in which tensor ops escape active dispatch modes (e.g. ``FlopCounterMode``), so a
    probe's timing runs are not counted as the model's work."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError:  # pragma: no cover (torch without the helper: probe inside the mode)
        return contextlib.nullcontext()
    return _disable_current_modes()
