"""Atomic checkpoint files: weights in safetensors, training state via ``torch.save``.

Every writer goes through ``atomic_write_bytes`` (temp file in the same folder, fsync, rename), so
a run killed while saving leaves the previous file intact; files get the mode the user's umask gives
(not mkstemp's 0600). Training states hold only tensors, numbers, strings, None and lists/tuples/dicts
of them, so ``torch.load(weights_only=True)`` reads them. Every loader names the file and the format
it expected when a file is unreadable (truncated, not that format, or a refused pickle).
"""

from __future__ import annotations

import io
import os
import random
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save as safetensors_bytes

_WEIGHT_SUBDICTS = ("model", "state_dict", "ema", "model_ema", "state_dict_ema")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers
TEMP_SUFFIX = ".tmp"  # atomic_write_bytes's temp files: ``.NAME.<pid>.<random>.tmp`` next to the target
SAFETENSORS_FORMAT = "a safetensors file (8-byte header length, JSON header, tensor bytes)"
TORCH_FORMAT = "a torch.save file (zip archive) holding only tensors, numbers, strings and containers"


def temp_path_for(path: Path) -> Path:
    """A fresh temp-file name next to ``path`` (same folder, so the final rename is atomic)."""
    return path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in folder ``path`` durable (no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_weights(
    path: str | Path, state_dict: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Save a state dict as safetensors (atomic). Tensors are copied to CPU, contiguous and unshared;
    ``metadata`` (strings) goes into the file's header."""
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state_dict.items()}
    atomic_write_bytes(path, safetensors_bytes(tensors, metadata=dict(metadata) if metadata else None))


def weights_metadata(path: str | Path) -> dict[str, str]:
    """The string metadata stored in a safetensors file's header."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError) as err:
        raise unreadable(path, SAFETENSORS_FORMAT, err) from None


def unreadable(path: str | Path, expected: str, err: BaseException) -> ValueError:
    """The error for a file that is not what it should be: its path, the expected format, the cause."""
    return ValueError(
        f"{path} is not readable as {expected}: {type(err).__name__}: {err}. The file may be truncated "
        "(a copy or save that was interrupted) or of another format; restore it or point to another file"
    )


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; ValueError naming the file on a truncated / foreign one."""
    try:
        return load_safetensors(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise unreadable(path, SAFETENSORS_FORMAT, err) from None


def read_torch_file(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU; ValueError naming the file when it is not a
    torch file or holds objects that weights_only refuses (pickled code is never run)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError, RuntimeError (bad zip), EOFError, ...
        raise unreadable(path, TORCH_FORMAT, err) from None


def strip_wrapper_prefixes(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) prefixes from every key."""
    out = {}
    for key, value in state_dict.items():
        changed = True
        while changed:
            changed = False
            for prefix in _WRAPPER_PREFIXES:
                if key.startswith(prefix):
                    key, changed = key[len(prefix) :], True
        out[key] = value
    return out


def load_weights(path: str | Path, prefer_ema: bool = False) -> dict[str, torch.Tensor]:
    """Model weights from a ``.safetensors`` file or a ``.pt``/``.pth``/``.bin`` file.

    Torch files may hold the state dict itself or wrap it (timm / DeiT / ours) under ``model``,
    ``state_dict``, ``ema`` (DiT), ``model_ema`` or ``state_dict_ema``; ``prefer_ema`` picks the EMA copy when
    there is one. DDP / compile prefixes are stripped.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weight file {path} does not exist; give the path of a .safetensors or .pth file")
    if path.suffix == ".safetensors":
        return strip_wrapper_prefixes(read_safetensors(path))
    obj = read_torch_file(path)
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path} holds a {type(obj).__name__}, not a state dict")
    order = _WEIGHT_SUBDICTS[2:] + _WEIGHT_SUBDICTS[:2] if prefer_ema else _WEIGHT_SUBDICTS
    for key in order:
        if isinstance(obj.get(key), Mapping):
            obj = obj[key]
            break
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError(f"{path} holds no tensors under any of {_WEIGHT_SUBDICTS} nor at its top level")
    return strip_wrapper_prefixes(tensors)


def _check_loadable(obj: Any, where: str = "state") -> None:
    if obj is None or isinstance(obj, (torch.Tensor, bool, int, float, str)):
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _check_loadable(k, where)
            _check_loadable(v, f"{where}[{k!r}]")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_loadable(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} is a {type(obj).__name__}; a training state holds only tensors, numbers, strings, "
        "None and lists/dicts of them (convert it first) so that torch.load(weights_only=True) reads it"
    )


def save_train_state(path: str | Path, state: Mapping[str, Any]) -> None:
    """``torch.save`` a training state (optimizer, scheduler, step, RNG...) atomically."""
    _check_loadable(state)
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    atomic_write_bytes(path, buffer.getvalue())


def load_train_state(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"training state {path} does not exist; was the run saved with this run dir?")
    state = read_torch_file(path)
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a training state (a dict); is it the right file?")
    return state


def rng_state() -> dict[str, Any]:
    """The RNG state of Python, NumPy, torch (and every CUDA device), as weights_only-loadable values."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, torch.tensor(words, dtype=torch.int64), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` captured."""
    version, words, gauss = state["python"]
    random.setstate((version, tuple(int(w) for w in words.tolist()), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
