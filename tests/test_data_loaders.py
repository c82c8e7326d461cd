import torch
from torch.utils.data import TensorDataset

from visattn.data.loaders import train_sampler


def _order(seed, epoch, repeated_aug=3):
    sampler = train_sampler(TensorDataset(torch.arange(64)), rank=0, world_size=1, seed=seed, repeated_aug=repeated_aug)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_repeated_augmentation_order_depends_on_seed_and_epoch():
    assert _order(seed=0, epoch=1) == _order(seed=0, epoch=1)
    assert _order(seed=0, epoch=1) != _order(seed=1, epoch=1)
    assert _order(seed=0, epoch=1) != _order(seed=0, epoch=2)


def test_plain_shuffle_order_depends_on_seed():
    assert _order(seed=0, epoch=0, repeated_aug=0) != _order(seed=1, epoch=0, repeated_aug=0)
