import warnings

import numpy as np
import torch
from torch.utils.data import TensorDataset

from visattn.data.latents import PixelData
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


def test_pixel_data_takes_a_read_only_array_without_sharing_it():
    """A memory-mapped / cached dataset arrives read-only: PixelData copies it (torch would warn
    that writing through the shared tensor is undefined) and leaves the caller's array alone."""
    images = np.arange(2 * 4 * 4, dtype=np.uint8).reshape(2, 4, 4, 1)
    images.flags.writeable = False
    labels = np.array([0, 1])
    labels.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = PixelData(images, labels)
    assert torch.equal(data.images, torch.from_numpy(images.copy())) and data.labels.tolist() == [0, 1]
    data.images.zero_()
    assert images.sum() > 0
