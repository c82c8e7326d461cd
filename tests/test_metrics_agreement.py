"""Class agreement, the sFID sample-size rule, and the metrics CLI's errors on unreadable files."""

import io

import numpy as np
import pytest
import torch

from visattn.metrics import GenerationScorer, ReferenceBatch, class_agreement, load_samples, save_npz_batch
from visattn.metrics.__main__ import main
from visattn.metrics.extractor import FeatureExtractor
from visattn.metrics.scorer import SFID_SAMPLES_PER_DIM, sfid_note


class PixelClassifier(FeatureExtractor):
    """A stand-in domain extractor: class = brightness bucket of the first pixel (10 buckets)."""

    def __init__(self, name: str = "digits"):
        super().__init__()
        self.name = name

    def forward(self, images):
        x = images.float().flatten(1) / 255.0  # [B, H*W*C]
        bucket = (x[:, 0] * 9.999).long()
        logits = torch.nn.functional.one_hot(bucket, 10).float()
        return x[:, :4], x[:, :2], logits


def images_of_classes(classes):
    """uint8 [N, 2, 2, 1] whose first pixel falls in each class's brightness bucket."""
    first = (np.asarray(classes) * 25.5 + 10).astype(np.uint8)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (len(classes), 2, 2, 1), dtype=np.uint8)
    images[:, 0, 0, 0] = first
    return images


def test_class_agreement_hand_computed():
    logits = np.array([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [0.0, 0.0, 1.0], [5.0, 0.0, 0.0]])
    assert class_agreement(logits, np.array([0, 1, 0, 2])) == 0.5  # rows 0 and 1 agree
    with pytest.raises(ValueError, match=r"lie in \[0, 3\)"):
        class_agreement(logits, np.array([0, 1, 0, 3]))
    with pytest.raises(ValueError, match="one label per sample"):
        class_agreement(logits, np.array([0, 1]))


def test_scorer_reports_agreement_only_with_labels_and_a_domain_extractor():
    classes = np.arange(40) % 10
    samples = images_of_classes(classes)
    labels = classes.copy()
    labels[:10] = (labels[:10] + 1) % 10  # 10 of 40 samples carry a label their image does not show
    scores = GenerationScorer(PixelClassifier()).score(samples, samples, labels=labels)
    assert scores["class_agreement"] == pytest.approx(0.75)
    assert GenerationScorer(PixelClassifier()).score(samples, samples)["class_agreement"] is None
    assert GenerationScorer(PixelClassifier("inception")).score(samples, samples, labels=labels)["class_agreement"] is None


def test_sfid_left_out_below_the_rule():
    assert sfid_note(SFID_SAMPLES_PER_DIM * 1568, 10_000, 1568) is not None  # the reference is too small
    note = sfid_note(5000, 10_000, 1568)
    assert note.startswith("left out") and "15680" in note and "5000 samples" in note
    assert sfid_note(20, 20, 2) is None
    samples = images_of_classes(np.arange(19) % 10)  # 19 images < 10 x 2-d spatial features
    scores = GenerationScorer(PixelClassifier()).score(samples, samples)
    assert scores["sfid"] is None and "20" in scores["sfid_note"]
    scores = GenerationScorer(PixelClassifier()).score(images_of_classes(np.arange(20) % 10), samples)
    assert scores["sfid"] is None  # the 19-image reference is below the rule too


def test_samples_round_trip_with_labels(tmp_path):
    images, labels = images_of_classes([1, 2, 3]), np.array([1, 2, 3])
    save_npz_batch(tmp_path / "s.npz", ReferenceBatch(images=images), labels=labels)
    got_images, got_labels = load_samples(tmp_path / "s.npz")
    assert np.array_equal(got_images, images) and np.array_equal(got_labels, labels)
    np.savez(tmp_path / "named.npz", arr_0=images, labels=labels)
    assert np.array_equal(load_samples(tmp_path / "named.npz")[1], labels)
    save_npz_batch(tmp_path / "plain.npz", ReferenceBatch(images=images))
    assert load_samples(tmp_path / "plain.npz")[1] is None


def test_cli_names_the_file_and_format_of_bad_inputs(tmp_path):
    images = images_of_classes([1, 2])
    (tmp_path / "text.npz").write_text("not an archive")
    np.save(tmp_path / "array.npy", images)
    np.savez(tmp_path / "noarr.npz", images=images)
    np.savez(tmp_path / "badlabels.npz", arr_0=images, arr_1=np.array([0.5, 1.5]))
    good = tmp_path / "good.npz"
    save_npz_batch(good, ReferenceBatch(images=images))
    cases = {
        "text.npz": "is not a zip archive",
        "array.npy": "is a single .npy array",
        "noarr.npz": r"has no arr_0 \(keys: \['images'\]\)",
        "badlabels.npz": "arr_1 of .* must be int labels",
        "missing.npz": "does not exist",
    }
    for name, message in cases.items():
        with pytest.raises((ValueError, FileNotFoundError), match=message) as err:
            main([str(tmp_path / name), str(good), "--extractor", "digits"])
        assert name in str(err.value)
        if name != "badlabels.npz":
            assert "arr_0 uint8 [N, H, W, C]" in str(err.value)
    buffer = io.BytesIO()
    np.savez(buffer, arr_0=images)
    (tmp_path / "cut.npz").write_bytes(buffer.getvalue()[:-40])
    with pytest.raises(ValueError, match="cut.npz"):
        main([str(tmp_path / "cut.npz"), str(good), "--extractor", "digits"])


def test_cli_names_a_truncated_weights_file(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(64)}, tmp_path / "full.safetensors")
    data = (tmp_path / "full.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    good = tmp_path / "good.npz"
    save_npz_batch(good, ReferenceBatch(images=images_of_classes([1, 2])))
    with pytest.raises(ValueError, match=r"cut\.safetensors could not be loaded.*expected a safetensors file"):
        main([str(good), str(good), "--extractor", "digits", "--weights", str(tmp_path / "cut.safetensors")])
