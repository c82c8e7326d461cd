"""Resuming in the middle of an epoch: skip the batches already trained on without loading them."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

from torch.utils.data import DataLoader, Sampler


class _SkipFirst(Sampler[int]):
    """``sampler`` without its first ``n`` indices (``set_epoch`` goes to ``sampler``)."""

    def __init__(self, sampler: Sampler[int], n: int) -> None:
        self.sampler, self.n = sampler, n

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.n, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.n)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]


@contextlib.contextmanager
def skip_first_batches(loader: DataLoader, batches: int) -> Iterator[DataLoader]:
    """Inside, iterating ``loader`` starts at batch ``batches`` of the epoch (call the sampler's
    ``set_epoch`` first, as usual). The indices are skipped, not the loading of the images."""
    batch_sampler = loader.batch_sampler
    if batches == 0 or batch_sampler is None:
        yield loader
        return
    original = batch_sampler.sampler
    batch_sampler.sampler = _SkipFirst(original, batches * batch_sampler.batch_size)
    try:
        yield loader
    finally:
        batch_sampler.sampler = original
