"""Logging set-up and the per-epoch / per-interval metrics log (``metrics.csv`` + TensorBoard)."""

from __future__ import annotations

import csv
import io
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from visattn.utils.checkpoint import atomic_write_bytes

METRICS_FILE = "metrics.csv"


def setup_logging(rank: int = 0, level: int = logging.INFO) -> None:
    """INFO on rank 0, WARNING elsewhere, so a DDP run logs each line once. Leaves handlers that
    Hydra installed in place."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(format="[%(asctime)s][%(name)s][%(levelname)s] %(message)s")
    root.setLevel(level if rank == 0 else logging.WARNING)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class MetricsLogger:
    """Rows of scalars to ``run_dir/metrics.csv`` (rewritten atomically, columns = union of keys)
    and to TensorBoard under ``run_dir/tb``.

    A row's ``step`` is the TensorBoard step. Values that are lists of numbers (e.g. per-layer
    head load) go to TensorBoard as ``key/i`` only. Rows already in ``metrics.csv`` are kept, so
    a resumed run continues the file; ``drop_after(step)`` forgets rows logged after a checkpoint.
    ``enabled=False`` (ranks other than 0) makes every call a no-op.
    """

    def __init__(self, run_dir: str | Path, tensorboard: bool = True, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self.rows: list[dict[str, Any]] = []
        self._tb = None
        if not enabled:
            return
        if self.path.is_file():
            with open(self.path, newline="") as f:
                self.rows = [{k: _parse(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tb"))

    def drop_after(self, step: int) -> None:
        if self.enabled:
            self.rows = [r for r in self.rows if r.get("step", 0) <= step]
            self._write_csv()

    def log(self, row: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        scalars = {k: v for k, v in row.items() if _is_number(v) or isinstance(v, str)}
        self.rows.append(scalars)
        self._write_csv()
        if self._tb is not None:
            step = int(row.get("step", len(self.rows)))
            for key, value in row.items():
                if key == "step":
                    continue
                if _is_number(value) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
                elif isinstance(value, (list, tuple)) and all(_is_number(v) for v in value):
                    for i, v in enumerate(value):
                        self._tb.add_scalar(f"{key}/{i}", v, step)
            self._tb.flush()

    def _write_csv(self) -> None:
        columns: list[str] = []
        for row in self.rows:
            columns += [k for k in row if k not in columns]
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write_bytes(self.path, buffer.getvalue().encode())

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _parse(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text
