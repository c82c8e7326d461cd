"""One live run per run dir: ``RUN_DIR/.run.lock`` names the holder (host, pid, SLURM job, start).

Taking the lock is an ``O_EXCL`` create, so two processes cannot both get it. An existing lock is
taken over (with a log line) when its holder is gone: same host and the pid is not alive, or the same
SLURM job id (a requeued job: SLURM never runs two instances of one job). A lock held by a live
process, or by a process on another host (whose liveness cannot be checked), is refused with a
message that names the holder and the fix (wait, pick another run dir, or delete the lock file if
that process is certainly dead).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"
EMPTY_LOCK_STALE_S = 10.0  # a lock file still empty / unreadable after this long was left by a crash


class RunDirBusy(RuntimeError):
    """Another live run holds the run dir."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _holder() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}


def _is_stale(other: dict[str, Any], me: dict[str, Any]) -> bool:
    if other.get("pid") == -1:
        return True
    if other.get("slurm_job_id") and other.get("slurm_job_id") == me["slurm_job_id"]:
        return other.get("host") != me["host"] or not _pid_alive(int(other.get("pid", -1)))
    return other.get("host") == me["host"] and not _pid_alive(int(other.get("pid", -1)))


def busy_message(path: Path, other: dict[str, Any]) -> str:
    return (f"run dir {path.parent} is in use by pid {other.get('pid')} on host {other.get('host')} "
            f"(started {other.get('started')}, command {other.get('argv')}); choose another run dir "
            f"(hydra.run.dir=...), wait for that run to end, or delete {path} if that process is certainly dead")


def refuse_busy_run_dir(argv: list[str]) -> None:
    """Before Hydra writes ``.hydra/`` into an explicit ``hydra.run.dir=DIR``: raise ``RunDirBusy``
    when a live run holds DIR, so a refused run does not overwrite that run's saved config."""
    for arg in argv:
        if arg.startswith("hydra.run.dir="):
            lock = RunLock(arg.split("=", 1)[1])
            holder = lock.live_holder()
            if holder is not None:
                raise RunDirBusy(busy_message(lock.path, holder))


class RunLock:
    """``with RunLock(run_dir):`` holds the run dir; raises ``RunDirBusy`` when another run does."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.me = _holder()
        self.held = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                other = self.live_holder()
                if other is not None:
                    raise RunDirBusy(busy_message(self.path, other)) from None
                other = self._read() or {}
                log.warning("taking over %s from pid %s on %s, which is no longer running",
                            self.path, other.get("pid"), other.get("host"))
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
            self.held = True
            return
        raise RunDirBusy(f"could not take {self.path}: other processes keep creating it")

    def live_holder(self) -> dict[str, Any] | None:
        """What the lock file says of its holder when that process may still run; None when the
        lock is free or stale (its holder is gone)."""
        if not self.path.exists():
            return None
        other = self._read()
        if other is None:  # being written this instant, or left empty by a crash: look again
            time.sleep(0.2)
            other = self._read()
        if other is None and self._age() > EMPTY_LOCK_STALE_S:
            return None  # an unreadable, old lock: nobody holds it
        other = other or {}
        return None if _is_stale(other, self.me) else other

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except OSError:
            return 0.0

    def _read(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self.held and (self._read() or {}).get("pid") == self.me["pid"]:
            self.path.unlink(missing_ok=True)
        self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
