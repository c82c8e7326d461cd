"""Data loaders for classification: per-rank sharding, repeated augmentation, Mixup/CutMix."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from timm.data import Mixup
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler


class ShardSampler(Sampler[int]):
    """Indices rank, rank + world, ...: every sample seen exactly once over all ranks (exact eval
    metrics under DDP, unlike ``DistributedSampler``'s padding)."""

    def __init__(self, size: int, rank: int = 0, world_size: int = 1) -> None:
        self.indices = range(rank, size, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class SeededRepeatAugSampler(RepeatAugSampler):
    """timm's repeated-augmentation sampler seeds its shuffle with the epoch alone, so every run
    seed would see the same order; fold the seed into the epoch it seeds with."""

    def __init__(self, dataset: Dataset, *, seed: int, **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(self.seed * 1_000_003 + epoch)


def train_sampler(dataset: Dataset, rank: int, world_size: int, seed: int, repeated_aug: int = 0) -> Sampler:
    """Shuffled shard of this rank, reshuffled per epoch via ``set_epoch`` (deterministic in
    ``seed`` and the epoch, so a resumed run sees the same order). ``repeated_aug`` > 1: each
    sample ``repeated_aug`` times per epoch on different ranks (DeiT's repeated augmentation)."""
    if repeated_aug > 1:
        return SeededRepeatAugSampler(
            dataset, seed=seed, num_replicas=world_size, rank=rank, shuffle=True, num_repeats=repeated_aug
        )
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)


def build_loaders(
    train_set: Dataset,
    val_set: Dataset,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    num_workers: int = 0,
    repeated_aug: int = 0,
    eval_batch_size: int | None = None,
    pin_memory: bool = False,
) -> tuple[DataLoader, DataLoader]:
    """(train, eval) loaders for one rank. ``batch_size`` is the global batch (split over ranks)."""
    if batch_size % world_size:
        raise ValueError(
            f"train.batch_size={batch_size} is not divisible by the {world_size} processes; "
            f"use a multiple of {world_size}"
        )
    per_rank = batch_size // world_size
    if per_rank > len(train_set) // world_size:
        raise ValueError(
            f"train.batch_size={batch_size} is larger than the training set ({len(train_set)} images); "
            f"lower train.batch_size"
        )
    common = dict(num_workers=num_workers, pin_memory=pin_memory, persistent_workers=num_workers > 0)
    train = DataLoader(
        train_set,
        batch_size=per_rank,
        sampler=train_sampler(train_set, rank, world_size, seed, repeated_aug),
        drop_last=True,
        **common,
    )
    val = DataLoader(
        val_set,
        batch_size=eval_batch_size or per_rank,
        sampler=ShardSampler(len(val_set), rank, world_size),
        **common,
    )
    return train, val


def build_mixup(aug: Mapping[str, Any], num_classes: int) -> Mixup | None:
    """timm's batch Mixup/CutMix (with label smoothing folded into the soft targets), or None
    when both alphas are 0."""
    mixup, cutmix = aug.get("mixup", 0.0), aug.get("cutmix", 0.0)
    if not (mixup > 0 or cutmix > 0):
        return None
    return Mixup(
        mixup_alpha=mixup,
        cutmix_alpha=cutmix,
        prob=aug.get("mixup_prob", 1.0),
        switch_prob=aug.get("mixup_switch_prob", 0.5),
        mode="batch",
        label_smoothing=aug.get("label_smoothing", 0.0),
        num_classes=num_classes,
    )
