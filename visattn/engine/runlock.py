"""One live run per run dir: ``RUN_DIR/.run.lock`` names the holder (host, pid, SLURM job and its
restart count, start).

Taking the lock is atomic with its content (a complete file linked into place, which fails when the
name exists), so two processes cannot both get it and no lock is ever empty. An existing lock is
taken over (with a log line) only when its holder is certainly gone: on the same host, its pid is
not alive; or it was an earlier instance of this SLURM job (same job id, lower restart count: SLURM
never runs two instances of one job, and a requeued job may land on another host). Everything else
is refused with a message that names the holder and the fix (wait, pick another run dir, or delete
the lock file if that process is certainly dead): a live process, a process on another host (whose
liveness cannot be checked, e.g. another task of this very job), an unreadable lock.
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
            "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0),  # requeues so far
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}


def _is_stale(other: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether the holder ``other`` is certainly gone (never guessed: an unknown is a live holder)."""
    job = other.get("slurm_job_id")
    if job and job == me["slurm_job_id"] and int(other.get("slurm_restart") or 0) < me["slurm_restart"]:
        return True  # an earlier instance of this job, which SLURM has ended before requeueing it
    pid = other.get("pid")
    if other.get("host") != me["host"] or not isinstance(pid, int):
        return False
    return not _pid_alive(pid)


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
        temp = self.path.with_name(f"{LOCK_FILE}.{socket.gethostname()}.{os.getpid()}")
        temp.write_text(json.dumps(self.me))
        try:
            for _ in range(3):
                try:
                    os.link(temp, self.path)  # atomic, and fails when the lock exists
                except FileExistsError:
                    other = self.live_holder()
                    if other is not None:
                        raise RunDirBusy(busy_message(self.path, other)) from None
                    other = self._read() or {}
                    log.warning("taking over %s from pid %s on %s (SLURM job %s, restart %s), which is no longer "
                                "running", self.path, other.get("pid"), other.get("host"), other.get("slurm_job_id"),
                                other.get("slurm_restart"))
                    self.path.unlink(missing_ok=True)
                    continue
                self.held = True
                return
        finally:
            temp.unlink(missing_ok=True)
        raise RunDirBusy(f"could not take {self.path}: other processes keep creating it")

    def live_holder(self) -> dict[str, Any] | None:
        """What the lock file says of its holder when that process may still run; None when the
        lock is free or stale (its holder is certainly gone)."""
        if not self.path.exists():
            return None
        other = self._read()
        if other is None:
            if not self.path.exists():
                return None
            return {"pid": "?", "host": "?", "started": "?", "argv": f"unreadable lock file {self.path}"}
        return None if _is_stale(other, self.me) else other

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
