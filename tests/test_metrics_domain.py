"""The digits domain extractor (trained once into a temporary cache), the scorer and the CLI on it."""

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch

from visattn.data.registry import load_arrays
from visattn.metrics import GenerationScorer, ReferenceBatch, build_extractor, save_npz_batch
from visattn.metrics.__main__ import main
from visattn.metrics.domain import DOMAIN_RECIPES, domain_extractor_path, train_domain_extractor


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # small convolutions on a shared 2-core machine: threads only add waiting
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("visattn_cache")


@pytest.fixture(scope="module")
def digits(cache_dir):
    return build_extractor("digits", cache_dir=cache_dir)


def test_digits_extractor_is_accurate_and_cached(digits, cache_dir, caplog):
    test_images, test_labels = load_arrays("digits", "test")
    accuracy = float((digits.extract(test_images).logits.argmax(1) == test_labels).mean())
    assert accuracy >= 0.97 and digits.test_accuracy == pytest.approx(accuracy)
    path = domain_extractor_path("digits", cache_dir)
    assert path.is_file() and path.name == f"digits-{DOMAIN_RECIPES['digits'].digest()}.safetensors"
    with caplog.at_level(logging.INFO):
        again = build_extractor("digits", cache_dir=cache_dir)
    assert "training" not in caplog.text and again.test_accuracy == pytest.approx(accuracy)
    np.testing.assert_array_equal(again.extract(test_images[:20]).pooled, digits.extract(test_images[:20]).pooled)


def test_training_is_deterministic(digits):
    retrained = train_domain_extractor(DOMAIN_RECIPES["digits"])
    for key, value in digits.state_dict().items():
        torch.testing.assert_close(retrained.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_features_have_the_documented_shapes_at_any_input_size(digits):
    images, _ = load_arrays("digits", "test")
    features = digits.extract(images[:10])
    assert features.pooled.shape == (10, 64) and features.logits.shape == (10, 10)
    assert features.spatial.shape == (10, 4 * 4 * 16)  # mid-level 4x4 map, first 16 channels, channels-last
    upscaled = np.repeat(np.repeat(np.repeat(images[:10], 2, axis=1), 2, axis=2), 3, axis=3)  # 16x16 RGB
    resized = digits.extract(upscaled)
    assert resized.spatial.shape == features.spatial.shape
    assert (resized.logits.argmax(1) == features.logits.argmax(1)).mean() >= 0.8


def test_scores_separate_real_digits_from_noise(digits):
    reference = load_arrays("digits", "test")[0]
    scorer = GenerationScorer(digits)
    stats = scorer.reference_stats(reference)
    train_images, train_labels = load_arrays("digits", "train")
    real = scorer.score(train_images[:400], stats, labels=train_labels[:400])
    noise = scorer.score(np.random.default_rng(0).integers(0, 256, size=(400, 8, 8, 1), dtype=np.uint8), stats,
                         labels=train_labels[:400])
    assert real["extractor"] == "digits" and real["num_samples"] == 400
    assert real["fid"] * 10 < noise["fid"]
    assert real["sfid"] is None and "2560" in real["sfid_note"]  # 400 images < 10 x 256-d spatial features
    assert real["class_agreement"] > 0.95 and noise["class_agreement"] < 0.5
    assert real["precision"] > 0.7 and real["recall"] > 0.7 and noise["precision"] < 0.1
    assert real["is"] > 5.0 and real["is"] > noise["is"]


def test_cli_prints_the_five_scores_as_json(digits, cache_dir, tmp_path, capsys):
    images = load_arrays("digits", "test")[0]
    save_npz_batch(tmp_path / "samples.npz", ReferenceBatch(images=images[:150]))
    save_npz_batch(tmp_path / "ref.npz", ReferenceBatch(images=images[150:]))
    main([str(tmp_path / "samples.npz"), str(tmp_path / "ref.npz"), "--extractor", "digits", "--cache-dir", str(cache_dir)])
    result = json.loads(capsys.readouterr().out)
    assert {"fid", "sfid", "is", "precision", "recall"} <= set(result)
    assert result["extractor"] == "digits" and result["num_samples"] == 150


def test_missing_weights_and_unknown_extractor_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.safetensors"):
        build_extractor("digits", weights=tmp_path / "nowhere.safetensors")
    with pytest.raises(ValueError, match="inception, digits, fashion_mnist"):
        build_extractor("cifar")


def test_cache_location_follows_env_and_recipe(tmp_path, monkeypatch):
    monkeypatch.setenv("VISATTN_CACHE", str(tmp_path))
    path = domain_extractor_path("digits")
    assert path.parent == tmp_path / "extractors" and path.name.startswith("digits-")
    changed = dataclasses.replace(DOMAIN_RECIPES["digits"], epochs=DOMAIN_RECIPES["digits"].epochs + 1)
    assert changed.digest() != DOMAIN_RECIPES["digits"].digest()
