"""The IDX file format of MNIST-style datasets (gzipped or not): read, and write for test data."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np


def _open_idx(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_idx(path: str | Path) -> np.ndarray:
    """Read an unsigned-byte IDX file into an array of the shape its header gives."""
    path = Path(path)
    with _open_idx(path) as f:
        zero, dtype_code, ndim = struct.unpack(">HBB", f.read(4))
        if zero != 0 or dtype_code != 0x08:
            raise ValueError(f"{path} is not an unsigned-byte IDX file (header {zero}, {dtype_code:#x})")
        shape = struct.unpack(f">{ndim}I", f.read(4 * ndim))
        data = np.frombuffer(f.read(), dtype=np.uint8)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path} is truncated: expected {int(np.prod(shape))} values, found {data.size}")
    return data.reshape(shape)


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write a uint8 array as a gzipped IDX file (used to build tiny test datasets)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())
