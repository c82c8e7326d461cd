"""Bad image files in an ImageFolder (the ImageNet case): a truncated JPEG and a non-image file named
.jpg in train/ and in val/. Error mode names the file and the fix; skip mode loads the rest and lists
exactly the bad files, also through DataLoader workers; verify_split finds them up front."""

import gc
import io
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torchvision.datasets import ImageFolder

from visattn.data.datasets import build_datasets
from visattn.data.images import BadImageError, ImageFolderSplit, decode_image, skipped_files
from visattn.data.loaders import build_loaders
from visattn.data.verify import find_bad_files, verify_split

GOOD_PER_CLASS = 3
NO_AUG = {"mixup": 0.0, "cutmix": 0.0, "repeated_aug": 0}


def _jpeg_bytes(rng, size=24) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture
def folder(tmp_path):
    """root/{train,val}/{cat,dog}/: 3 good images per class (JPEG and PNG), plus per split a truncated
    JPEG (cat/) and a text file named .jpg (dog/). Returns (root, {split: sorted bad paths})."""
    rng = np.random.default_rng(0)
    root, bad = tmp_path / "data", {}
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            (root / split / cls).mkdir(parents=True)
            for i in range(GOOD_PER_CLASS - 1):
                (root / split / cls / f"good{i}.jpg").write_bytes(_jpeg_bytes(rng))
            Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(root / split / cls / "good.png")
        truncated, not_image = root / split / "cat" / "truncated.jpg", root / split / "dog" / "notes.jpg"
        whole = _jpeg_bytes(rng, size=64)
        truncated.write_bytes(whole[: len(whole) // 2])
        not_image.write_text("this is not an image\n")
        bad[split] = sorted([str(truncated), str(not_image)])
    return root, bad


def data_config(root, **overrides):
    return {"name": "imagefolder", "root": str(root), "image_size": 16, "in_chans": 3, "num_classes": 2,
            "mean": [0.5] * 3, "std": [0.5] * 3, "num_workers": 0, "verify_train": "none", "verify_val": "none",
            **overrides}


def test_decode_error_names_the_file_and_the_fix(folder):
    root, bad = folder
    for path in bad["train"]:
        with pytest.raises(BadImageError, match=re.escape(path) + r".*data.bad_images=skip") as info:
            decode_image(path)
        assert info.value.path == path
    assert decode_image(root / "train" / "cat" / "good0.jpg").size == (24, 24)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_error_mode_loader_names_the_bad_file(folder, num_workers):
    root, bad = folder
    train, val = build_datasets(data_config(root), NO_AUG)
    _, val_loader = build_loaders(train, val, batch_size=2, num_workers=num_workers)
    first_bad = bad["val"][0]  # val/cat/truncated.jpg: the 4th file in order
    assert first_bad.endswith("truncated.jpg")
    with pytest.raises(BadImageError, match=re.escape(first_bad) + r".*data.bad_images=skip"):
        for _ in val_loader:
            pass


def test_error_mode_stops_before_training_with_every_bad_val_file(folder):
    root, bad = folder
    with pytest.raises(BadImageError) as info:
        build_datasets(data_config(root, verify_val="header"), NO_AUG)
    message = str(info.value)
    assert "2 of 8 image files" in message and "data.bad_images=skip" in message
    assert all(path in message for path in bad["val"]) and not any(path in message for path in bad["train"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_mode_loads_the_rest_and_lists_exactly_the_bad_files(folder, num_workers):
    root, bad = folder
    train, val = build_datasets(data_config(root, bad_images="skip"), NO_AUG)
    train_loader, val_loader = build_loaders(train, val, batch_size=4, num_workers=num_workers)
    for epoch in range(2):
        train_loader.sampler.set_epoch(epoch)
        train_shapes = [tuple(x.shape) for x, _ in train_loader]
        assert train_shapes == [(4, 3, 16, 16)] * 2  # a bad file's slot is filled: batches keep their size
    seen = sum(len(y) for _, y in val_loader)
    assert seen == len(val) == 2 * (GOOD_PER_CLASS + 1)
    assert [b.path for b in train.skipped_files()] == bad["train"]
    assert [b.path for b in val.skipped_files()] == bad["val"]
    listed = skipped_files(train, val)
    assert [entry["path"] for entry in listed] == sorted(bad["train"] + bad["val"])
    reasons = {Path(e["path"]).name: e["reason"] for e in listed}
    assert "truncated" in reasons["truncated.jpg"] and "UnidentifiedImageError" in reasons["notes.jpg"]


def test_skip_mode_logs_each_bad_file_once(folder, caplog):
    root, bad = folder
    train, val = build_datasets(data_config(root, bad_images="skip"), NO_AUG)
    with caplog.at_level(logging.WARNING, logger="visattn.data.images"):
        for _ in range(3):
            for i in range(len(train)):
                train[i]
    logged = [r.getMessage() for r in caplog.records if "skipping undecodable" in r.getMessage()]
    assert len(logged) == 2 and all(any(path in m for m in logged) for path in bad["train"])


def test_skip_mode_with_up_front_check_drops_the_bad_files(folder):
    root, bad = folder
    config = data_config(root, bad_images="skip", verify_train="decode", verify_val="header")
    train, val = build_datasets(config, NO_AUG)
    assert len(train) == len(val) == 2 * GOOD_PER_CLASS
    assert not set(bad["train"]) & {path for path, _ in train.samples}
    assert train.targets == [label for _, label in train.samples]
    assert [b.path for b in train.skipped_files()] == bad["train"]
    assert [b.path for b in val.skipped_files()] == bad["val"]
    assert all(x.shape == (3, 16, 16) for x, _ in val)


@pytest.mark.parametrize("level", ["header", "decode"])
def test_verify_split_finds_the_bad_files(folder, level):
    root, bad = folder
    with pytest.raises(BadImageError, match="2 of 8 image files") as info:
        verify_split(ImageFolderSplit(root / "train"), "error", level)
    assert all(path in str(info.value) for path in bad["train"])
    plain = ImageFolder(str(root / "val"))  # torchvision's own class works too
    found = verify_split(plain, "skip", level, workers=2)
    assert [b.path for b in found] == bad["val"] and len(plain.samples) == len(plain.targets) == 6


def test_header_check_has_no_false_alarm_on_bytes_after_the_jpeg_end(tmp_path):
    rng = np.random.default_rng(1)
    padded, long_tail = tmp_path / "padded.jpg", tmp_path / "long_tail.jpg"
    padded.write_bytes(_jpeg_bytes(rng) + b"\0" * 100)
    long_tail.write_bytes(_jpeg_bytes(rng) + os.urandom(10_000))  # end marker beyond the tail: decoded to decide
    assert find_bad_files([str(padded), str(long_tail)], "header") == []


def test_skip_record_folder_is_removed_with_the_dataset(folder):
    root, _ = folder
    dataset = ImageFolderSplit(root / "train", bad_images="skip")
    for i in range(len(dataset)):
        dataset[i]
    record_folder = dataset.skip_record.folder
    assert len(os.listdir(record_folder)) == 2
    del dataset
    gc.collect()
    assert not os.path.exists(record_folder)


def test_unknown_bad_images_mode_names_key(folder):
    root, _ = folder
    with pytest.raises(ValueError, match=r"data.bad_images='ignore' is not known.*'error', 'skip'"):
        build_datasets(data_config(root, bad_images="ignore"), NO_AUG)
    with pytest.raises(ValueError, match=r"data.verify_val='full' is not known.*'header', 'decode'"):
        build_datasets(data_config(root, verify_val="full"), NO_AUG)


def test_skip_mode_trains_through_the_classification_engine(folder, tmp_path):
    from hydra import compose, initialize_config_dir

    from visattn.engine.cls.trainer import run_cls

    root, _ = folder
    overrides = [
        "data=imagefolder", f"data.root={root}", "data.image_size=16", "data.num_classes=2", "data.num_workers=2",
        "data.bad_images=skip", "data.verify_val=none", "model=vit_tiny_patch4_32", "+model.kwargs.embed_dim=16",
        "+model.kwargs.depth=1", "+model.kwargs.num_heads=4", "aug=none", "train.batch_size=4", "train.epochs=1",
        "sched.warmup_epochs=0", "train.tensorboard=false", "train.progress=false", "train.num_threads=null",
    ]
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        results = run_cls(compose("train_cls", overrides=overrides), tmp_path / "run")
    assert results["train_steps"] == 2 and 0.0 <= results["top1"] <= 1.0  # 8 slots, batch 4: no crash, no epoch lost
