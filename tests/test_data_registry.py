"""The array-dataset registry: built-in facts, and a new dataset registered from one module-level
loader plus one config dict loads, batches and trains with no other code touched."""

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir

from visattn.data.datasets import build_datasets, check_data_config
from visattn.data.loaders import build_loaders
from visattn.data.registry import (
    ArrayDatasetSpec,
    class_names,
    dataset_names,
    domain_extractor,
    get_array_dataset,
    load_arrays,
    register_array_dataset,
    unregister_array_dataset,
)

CONF = Path(__file__).resolve().parents[1] / "conf"
NO_AUG = {"mixup": 0.0, "cutmix": 0.0, "repeated_aug": 0}


def load_toy_arrays(split, root):
    """24 train / 12 test random 6x6 RGB images in 3 classes."""
    rng = np.random.default_rng(0 if split == "train" else 1)
    n = 24 if split == "train" else 12
    return rng.integers(0, 256, (n, 6, 6, 3), dtype=np.uint8), np.arange(n, dtype=np.int64) % 3


TOY = ArrayDatasetSpec(name="toy", load=load_toy_arrays, classes=("ant", "bee", "cat"), image_size=6, channels=3)
TOY_DATA = {"name": "toy", "root": None, "image_size": 8, "in_chans": 3, "num_classes": 3,
            "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "num_workers": 0}


@pytest.fixture
def toy():
    register_array_dataset(TOY)
    yield TOY
    unregister_array_dataset(TOY.name)


def test_builtin_datasets_answer_their_facts():
    digits, fashion = get_array_dataset("digits"), get_array_dataset("fashion_mnist")
    assert (digits.image_size, digits.channels, digits.num_classes, digits.splits) == (8, 1, 10, ("train", "test"))
    assert digits.default_root is None and digits.extractor == "digits"
    assert fashion.classes[0] == "T-shirt/top" and fashion.num_classes == 10 and fashion.image_size == 28
    assert str(fashion.default_root) == "/usr/share/datasets/fashion-mnist" and domain_extractor("fashion_mnist")
    assert domain_extractor("imagefolder") is None
    assert dataset_names()[-2:] == ["imagefolder", "fake"] and {"digits", "fashion_mnist"} <= set(dataset_names())
    images, labels = load_arrays("digits", "test")
    assert images.shape == (359, 8, 8, 1) and images.dtype == np.uint8 and labels.dtype == np.int64


def test_registered_toy_dataset_builds_batches_and_names_classes(toy):
    assert "toy" in dataset_names() and class_names("toy", 3) == ["ant", "bee", "cat"]
    assert domain_extractor("toy") is None
    images, labels = load_arrays("toy", "test")
    assert images.shape == (12, 6, 6, 3) and labels.tolist()[:4] == [0, 1, 2, 0]
    train, val = build_datasets(TOY_DATA, NO_AUG)
    assert (len(train), len(val)) == (24, 12)
    train_loader, val_loader = build_loaders(train, val, batch_size=8)
    x, y = next(iter(train_loader))
    assert x.shape == (8, 3, 8, 8) and x.dtype == torch.float32 and y.max() < 3  # resized 6 -> 8


def test_registered_toy_dataset_trains_through_the_classification_engine(toy, tmp_path):
    from visattn.engine.cls.trainer import run_cls

    overrides = [
        "data.name=toy", "data.in_chans=3", "data.num_classes=3", "data.mean=[0.5,0.5,0.5]", "data.std=[0.5,0.5,0.5]",
        "+model.kwargs.embed_dim=16", "+model.kwargs.depth=1", "+model.kwargs.num_heads=4", "train.epochs=1",
        "sched.warmup_epochs=0", "train.batch_size=8", "train.tensorboard=false", "train.progress=false",
        "train.num_threads=null", "aug=none",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train_cls", overrides=overrides)
    results = run_cls(cfg, tmp_path)
    assert results["train_steps"] == 3 and 0.0 <= results["top1"] <= 1.0  # 24 images, batch 8
    assert json.loads((tmp_path / "head_load.json").read_text())["classes"] == ["ant", "bee", "cat"]


def test_data_module_key_imports_a_dataset_module_from_outside(tmp_path, monkeypatch):
    (tmp_path / "outside_sets.py").write_text(textwrap.dedent("""
        import numpy as np
        from visattn.data.registry import ArrayDatasetSpec, register_array_dataset

        def load(split, root):
            return np.zeros((4, 5, 5, 1), np.uint8), np.array([0, 1, 0, 1], np.int64)

        register_array_dataset(ArrayDatasetSpec("outside", load, ("no", "yes"), image_size=5, channels=1))
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    data = {**TOY_DATA, "name": "outside", "module": "outside_sets", "in_chans": 1, "num_classes": 2,
            "mean": [0.5], "std": [0.5], "image_size": 5}
    try:
        train, val = build_datasets(data, NO_AUG)
        assert len(train) == len(val) == 4 and train[0][0].shape == (1, 5, 5)
    finally:
        unregister_array_dataset("outside")
        sys.modules.pop("outside_sets", None)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"name": "toys"}, ValueError, r"data.name='toys' is not known.*'toy'.*data.module"),
        ({"in_chans": 1, "mean": [0.5], "std": [0.5]}, ValueError, r"data.in_chans=1 but dataset toy has 3"),
        ({"num_classes": 10}, ValueError, r"data.num_classes=10 but dataset toy has 3; set data.num_classes=3"),
        ({"root": "/no/such/dir"}, FileNotFoundError, r"data.root=/no/such/dir does not exist.*toy files"),
        ({"module": "no_such_module_xyz"}, ValueError, r"data.module='no_such_module_xyz' cannot be imported"),
    ],
)
def test_bad_data_config_names_key_and_fix(toy, change, error, match):
    with pytest.raises(error, match=match):
        check_data_config({**TOY_DATA, **change})


def test_registry_refuses_bad_specs_and_bad_arrays(toy):
    with pytest.raises(ValueError, match="'toy' is already registered"):
        register_array_dataset(ArrayDatasetSpec("toy", load_toy_arrays, ("x",), image_size=6, channels=3))
    register_array_dataset(TOY)  # the same spec again: a no-op
    with pytest.raises(ValueError, match="channels=2"):
        ArrayDatasetSpec("two", load_toy_arrays, ("x",), image_size=6, channels=2)
    with pytest.raises(ValueError, match="taken"):
        ArrayDatasetSpec("fake", load_toy_arrays, ("x",), image_size=6, channels=3)
    with pytest.raises(ValueError, match="split='val' is not a split of toy"):
        load_arrays("toy", "val")
    grey = ArrayDatasetSpec("grey_toy", load_toy_arrays, ("a", "b", "c"), image_size=6, channels=1)
    register_array_dataset(grey)
    try:
        with pytest.raises(ValueError, match="dataset grey_toy .*returned 3 channels; its spec says channels=1"):
            load_arrays("grey_toy")
    finally:
        unregister_array_dataset("grey_toy")
    with pytest.raises(ValueError, match="no array loader; registered: .*digits"):
        get_array_dataset("imagefolder")
