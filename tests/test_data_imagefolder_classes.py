"""data=imagefolder: the class folders of train/ and val/ define one label set."""

import pytest
from PIL import Image

from visattn.data.datasets import build_datasets
from visattn.data.images import ImageFolderSplit

NO_AUG = {"mixup": 0.0, "cutmix": 0.0, "repeated_aug": 0}


def make_folder(root, classes_per_split):
    for split, classes in classes_per_split.items():
        for name in classes:
            (root / split / name).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(root / split / name / "0.png")
    return root


def data_config(root, num_classes=3):
    return {"name": "imagefolder", "root": str(root), "image_size": 8, "in_chans": 3, "num_classes": num_classes,
            "mean": [0.5] * 3, "std": [0.5] * 3, "num_workers": 0, "verify_train": "none", "verify_val": "none"}


def test_val_classes_that_differ_from_train_stop_the_run(tmp_path):
    """Labels are the sorted folder names of each split: a val/ without 'ant' would label its 'bee'
    images 0, train's 'ant', and every score would be wrong without a word."""
    root = make_folder(tmp_path, {"train": ["ant", "bee", "cat"], "val": ["bee", "cat"]})
    with pytest.raises(ValueError, match=r"only train/ has \['ant'\]\. Both splits need the same class folders"):
        build_datasets(data_config(root), NO_AUG)


def test_same_classes_give_the_same_labels(tmp_path):
    root = make_folder(tmp_path, {"train": ["ant", "bee", "cat"], "val": ["ant", "bee", "cat"]})
    train, val = build_datasets(data_config(root), NO_AUG)
    assert train.class_to_idx == val.class_to_idx == {"ant": 0, "bee": 1, "cat": 2}


def test_an_empty_class_folder_is_named_with_its_path(tmp_path):
    root = make_folder(tmp_path, {"train": ["ant", "bee"], "val": ["ant", "bee"]})
    for split in ("train", "val"):
        (root / split / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=f"{root / 'train'}.*empty.*(remove|delete)"):
        build_datasets(data_config(root), NO_AUG)


def test_a_missing_split_or_one_without_class_folders_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'train'} is not a folder.*<class>/<image>"):
        ImageFolderSplit(tmp_path / "train")
    (tmp_path / "train").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "train" / "loose.png")  # images straight in the split
    with pytest.raises(FileNotFoundError, match="holds no class folders; put each class's images in"):
        ImageFolderSplit(tmp_path / "train")
