"""Up-front check of an image split, so a bad file stops a run before training, not after an epoch.

``verify_split(dataset, bad_images, level)`` checks every file of an image-folder split:

- ``level="header"`` (cheap): open the file and identify its format and size from the header; a
  JPEG must end in its end-of-image marker (a truncated one does not) and a PNG's chunks must
  pass their checksums. A file failing these is then fully decoded, and only a file that fails to
  decode is reported, so a JPEG with trailing bytes after its end marker is no false alarm.
- ``level="decode"``: fully decode every file, as training would (the cost of a data epoch
  without the transforms); also finds corrupt data inside a file whose header and end are intact.

In error mode it raises ``BadImageError`` listing the bad files; in skip mode it returns them,
drops them from the dataset and records them in its skip list.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from PIL import Image

from .images import FIX, BadFile, BadImageError, check_bad_images_mode, decode_image, describe

logger = logging.getLogger(__name__)

VERIFY_LEVELS = ("none", "header", "decode")
JPEG_END = b"\xff\xd9"
JPEG_TAIL_BYTES = 4096  # the end marker is looked for in this many last bytes (padding after it is allowed)
LISTED_IN_ERROR = 20


def check_verify_level(key: str, level: str) -> str:
    if level not in VERIFY_LEVELS:
        raise ValueError(f"{key}={level!r} is not known; use one of {VERIFY_LEVELS}")
    return level


def _jpeg_has_end_marker(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - JPEG_TAIL_BYTES))
        return JPEG_END in f.read()


def _header_suspect(path: str) -> bool:
    """True when the header check does not vouch for the file (it is then decoded to decide)."""
    try:
        with Image.open(path) as image:
            fmt = image.format
            if fmt == "PNG":
                image.verify()
    except Exception:
        return True
    return fmt == "JPEG" and not _jpeg_has_end_marker(path)


def check_image_file(path: str, level: str = "header") -> BadFile | None:
    """None when ``path`` decodes (``level="decode"``) or passes the header check; else why not."""
    if level == "header" and not _header_suspect(path):
        return None
    try:
        decode_image(path)
    except BadImageError as err:
        return BadFile(path, describe(err.__cause__ or err))
    return None


def find_bad_files(paths: Iterable[str], level: str = "header", workers: int = 1) -> list[BadFile]:
    """The files of ``paths`` that fail ``check_image_file``, in the given order; ``workers`` threads
    (PIL decodes without the GIL, and the check is mostly file I/O)."""
    paths = list(paths)
    if workers <= 1:
        results = [check_image_file(path, level) for path in paths]
    else:
        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(lambda path: check_image_file(path, level), paths))
    return [bad for bad in results if bad is not None]


def verify_split(dataset: Any, bad_images: str = "error", level: str = "header", workers: int = 1) -> list[BadFile]:
    """Check every file of an image-folder ``dataset`` (anything with ``samples: [(path, label)]``;
    other datasets have no files and pass).

    ``bad_images="error"``: raise ``BadImageError`` listing the bad files and the fix.
    ``bad_images="skip"``: return them, drop them from ``dataset`` (``dataset.drop``, else its
    ``samples``) and record them in its skip list when it keeps one (``record_skipped``).
    """
    check_bad_images_mode(bad_images)
    check_verify_level("level", level)
    samples = getattr(dataset, "samples", None)
    if level == "none" or samples is None:
        return []
    start = time.perf_counter()
    bad = find_bad_files((str(path) for path, _ in samples), level, workers)
    where = getattr(dataset, "root", "the split")
    logger.info("checked %d image files of %s (%s) in %.1f s: %d bad", len(samples), where, level,
                time.perf_counter() - start, len(bad))
    if not bad:
        return []
    if bad_images == "error":
        listed = "\n".join(f"  {b.path}: {b.reason}" for b in bad[:LISTED_IN_ERROR])
        more = f"\n  ... and {len(bad) - LISTED_IN_ERROR} more" if len(bad) > LISTED_IN_ERROR else ""
        raise BadImageError(f"{len(bad)} of {len(samples)} image files in {where} cannot be decoded:\n{listed}{more}\n"
                            f"Fix: {FIX}", path=bad[0].path)
    _leave_out(dataset, bad)
    return bad


def _leave_out(dataset: Any, bad: list[BadFile]) -> None:
    paths = {b.path for b in bad}
    if hasattr(dataset, "drop"):
        dataset.drop(paths)
    else:  # a plain torchvision ImageFolder
        dataset.samples = [(path, target) for path, target in dataset.samples if str(path) not in paths]
        dataset.imgs = dataset.samples
        dataset.targets = [target for _, target in dataset.samples]
    record = getattr(dataset, "record_skipped", None)
    for b in bad:
        if record is not None:
            record(b)
        else:
            logger.warning("leaving out undecodable image file %s (%s)", b.path, b.reason)
