"""Image files that fail to decode: errors that name the file, or skipping them (``data.bad_images``).

``ImageFolderSplit`` is torchvision's ``ImageFolder`` whose loader names the file it could not
decode. With ``bad_images="error"`` (the default) the error says which file and how to fix it;
with ``"skip"`` a bad file's place is taken by the next good file of the split (so batches keep
their size, as Mixup and DDP need) and the file is recorded once, over the main process and every
DataLoader worker, in a ``SkipRecord``; ``dataset.skipped_files()`` or ``skipped_files(*datasets)``
lists them in the main process (for the log and results.json).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from torchvision.datasets import ImageFolder

logger = logging.getLogger(__name__)

BAD_IMAGE_MODES = ("error", "skip")
# In skip mode, give up after this many consecutive undecodable files (a broken mount, not bad files).
MAX_CONSECUTIVE_BAD = 32
FIX = (
    "replace or delete the file, or set data.bad_images=skip to leave undecodable files out "
    "(they are listed in the log and in results.json)"
)


@dataclass(frozen=True)
class BadFile:
    path: str
    reason: str  # the decoder's error, e.g. "OSError: image file is truncated (146 bytes not processed)"


class BadImageError(ValueError):
    """An image file that cannot be decoded; ``path`` names it (also in the message).

    Constructible from the message alone, so a DataLoader worker's error re-raises as this type.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


def check_bad_images_mode(mode: str) -> str:
    if mode not in BAD_IMAGE_MODES:
        raise ValueError(f"data.bad_images={mode!r} is not known; use one of {BAD_IMAGE_MODES}")
    return mode


def decode_image(path: str | Path) -> Image.Image:
    """The RGB image in ``path``, fully decoded; ``BadImageError`` naming the file if it cannot be.

    PIL reports corrupt data through many exception types (OSError, SyntaxError, ValueError,
    struct.error, DecompressionBombError, ...), so any ``Exception`` from opening or decoding
    counts as a bad file.
    """
    try:
        with open(path, "rb") as f, Image.open(f) as image:
            return image.convert("RGB")
    except Exception as err:
        raise BadImageError(f"cannot decode image file {path} ({describe(err)}): {FIX}", path=str(path)) from err


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _remove_folder(folder: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # never from a forked DataLoader worker's copy
        shutil.rmtree(folder, ignore_errors=True)


class SkipRecord:
    """The set of skipped files, shared by a dataset's copies in DataLoader worker processes.

    One marker file per bad path in a private temporary folder, published with ``os.link`` (which
    fails when the marker exists), so each path is recorded, and logged, exactly once over all
    processes of one node. The folder is removed when the main process's record is collected.
    """

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="visattn-skipped-")
        self._finalizer = weakref.finalize(self, _remove_folder, self.folder, os.getpid())

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder}  # a worker's copy shares the folder, never removes it

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.folder = state["folder"]

    def add(self, bad: BadFile) -> bool:
        """Record ``bad``; True when this call recorded it first (the caller then logs it)."""
        marker = os.path.join(self.folder, hashlib.sha1(bad.path.encode()).hexdigest() + ".json")
        if os.path.exists(marker):
            return False
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"path": bad.path, "reason": bad.reason}, f)
            os.link(tmp, marker)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def files(self) -> list[BadFile]:
        entries = []
        for name in os.listdir(self.folder):
            if name.endswith(".json"):
                with open(os.path.join(self.folder, name)) as f:
                    entries.append(BadFile(**json.load(f)))
        return sorted(entries, key=lambda bad: bad.path)


class ImageFolderSplit(ImageFolder):
    """ImageFolder ``root/<class>/<image>`` yielding ``(transform(RGB image), label)``; undecodable
    files raise ``BadImageError`` naming them (``bad_images="error"``) or are skipped and recorded
    (``"skip"``)."""

    def __init__(self, root: str | Path, transform: Callable | None = None, bad_images: str = "error") -> None:
        if not Path(root).is_dir():
            raise FileNotFoundError(f"{root} is not a folder; an ImageFolder split is a folder of class folders, "
                                    f"{root}/<class>/<image>")
        try:
            super().__init__(str(root), transform=transform)
        except FileNotFoundError as err:  # torchvision names an empty class folder, not where it is
            if not any(entry.is_dir() for entry in Path(root).iterdir()):
                raise FileNotFoundError(f"{root} holds no class folders; put each class's images in "
                                        f"{root}/<class>/") from None
            raise FileNotFoundError(f"{root}: {err}. Every folder in {root} is a class: remove an empty class "
                                    f"folder or add its images") from None
        self.bad_images = check_bad_images_mode(bad_images)
        self.skip_record = SkipRecord() if bad_images == "skip" else None

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if self.skip_record is None:
            path, target = self.samples[index]
            return self._transformed(decode_image(path), target)
        if not -len(self.samples) <= index < len(self.samples):
            raise IndexError(f"index {index} is out of range for {len(self.samples)} files of {self.root}")
        index %= len(self.samples)
        tries = min(MAX_CONSECUTIVE_BAD, len(self.samples))
        for offset in range(tries):
            path, target = self.samples[(index + offset) % len(self.samples)]
            try:
                image = decode_image(path)
            except BadImageError as err:
                self.record_skipped(BadFile(str(path), describe(err.__cause__ or err)))
                continue
            return self._transformed(image, target)
        raise BadImageError(
            f"{tries} consecutive files of {self.root} from index {index} cannot be decoded "
            f"(e.g. {self.samples[index][0]}); check that the folder is readable and holds images",
            path=str(self.samples[index][0]),
        )

    def _transformed(self, image: Image.Image, target: int) -> tuple[Any, int]:
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

    def record_skipped(self, bad: BadFile) -> None:
        """Note a skipped file (once over all processes) and log it the first time."""
        if self.skip_record is None:
            raise ValueError(f"{self.root}: record_skipped needs bad_images='skip'")
        if self.skip_record.add(bad):
            logger.warning("skipping undecodable image file %s (%s); data.bad_images=skip", bad.path, bad.reason)

    def drop(self, paths: set[str]) -> None:
        """Leave the files ``paths`` out of the split (after an up-front check found them bad)."""
        self.samples = [(path, target) for path, target in self.samples if path not in paths]
        self.imgs = self.samples
        self.targets = [target for _, target in self.samples]

    def skipped_files(self) -> list[BadFile]:
        """Files skipped so far, by any process (sorted by path); empty in error mode."""
        return self.skip_record.files() if self.skip_record is not None else []


def skipped_files(*datasets: Any) -> list[dict[str, str]]:
    """``[{"path", "reason"}, ...]`` over ``datasets`` (any kind; those that skip nothing give none),
    in the main process, ready for results.json."""
    found: dict[str, BadFile] = {}
    for dataset in datasets:
        accessor = getattr(dataset, "skipped_files", None)
        for bad in accessor() if accessor is not None else []:
            found.setdefault(bad.path, bad)
    return [{"path": bad.path, "reason": bad.reason} for bad in sorted(found.values(), key=lambda b: b.path)]
