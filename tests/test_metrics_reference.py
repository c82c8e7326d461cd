"""ADM reference batches (npz round trip, centre crop, building) and the scorer on a toy extractor."""

import dataclasses
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from visattn.metrics import (
    FeatureExtractor,
    GenerationScorer,
    ReferenceBatch,
    build_reference,
    center_crop_arr,
    feature_statistics,
    folder_images,
    frechet_distance,
    load_npz_batch,
    save_npz_batch,
)


class PixelExtractor(FeatureExtractor):
    """Toy extractor: row means (pooled), all pixels channels-last (spatial), column means (logits)."""

    name = "pixels"

    def forward(self, images):
        x = images.float() / 255.0  # [B, H, W, C]
        return x.mean(dim=(2, 3)), x.flatten(1), x.mean(dim=(1, 3))


def _images(n, size=8, channels=1, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(n, size, size, channels), dtype=np.uint8)


def test_npz_round_trip_keeps_images_statistics_and_extractor(tmp_path):
    rng = np.random.default_rng(0)
    batch = ReferenceBatch(
        images=_images(5, channels=3), mu=rng.normal(size=4), sigma=np.eye(4), mu_s=rng.normal(size=6),
        sigma_s=2 * np.eye(6), extractor="digits",
    )
    save_npz_batch(tmp_path / "ref.npz", batch)
    loaded = load_npz_batch(tmp_path / "ref.npz")
    with np.load(tmp_path / "ref.npz") as raw:  # ADM's key names, readable without pickle
        assert set(raw.keys()) == {"arr_0", "mu", "sigma", "mu_s", "sigma_s", "extractor"}
    assert loaded.extractor == "digits" and loaded.images.dtype == np.uint8
    for key in ("images", "mu", "sigma", "mu_s", "sigma_s"):
        np.testing.assert_array_equal(getattr(loaded, key), getattr(batch, key))


def test_npz_samples_without_statistics_and_bad_files(tmp_path):
    np.savez(tmp_path / "samples.npz", arr_0=_images(3), arr_1=np.arange(3))  # ADM sample batch: images + labels
    loaded = load_npz_batch(tmp_path / "samples.npz")
    assert not loaded.has_statistics and loaded.extractor is None and loaded.images.shape == (3, 8, 8, 1)
    np.savez(tmp_path / "partial.npz", arr_0=_images(3), mu=np.zeros(2))
    with pytest.raises(ValueError, match="not all of"):
        load_npz_batch(tmp_path / "partial.npz")
    np.savez(tmp_path / "floats.npz", arr_0=np.zeros((2, 8, 8, 3), np.float32))
    with pytest.raises(ValueError, match="uint8"):
        load_npz_batch(tmp_path / "floats.npz")
    np.savez(tmp_path / "other.npz", images=_images(2))
    with pytest.raises(ValueError, match="no arr_0"):
        load_npz_batch(tmp_path / "other.npz")
    with pytest.raises(FileNotFoundError, match="missing.npz"):
        load_npz_batch(tmp_path / "missing.npz")


def test_center_crop_follows_adm_box_then_bicubic_then_crop():
    array = np.random.default_rng(1).integers(0, 256, size=(48, 64, 3), dtype=np.uint8)  # H=48, W=64
    out = center_crop_arr(Image.fromarray(array), 16)
    # ADM: 64x48 -BOX-> 32x24 (short side 24 < 2*16 stops), -BICUBIC-> 21x16, crop columns 2..18
    halved = Image.fromarray(array).resize((32, 24), resample=Image.Resampling.BOX)
    expected = np.asarray(halved.resize((21, 16), resample=Image.Resampling.BICUBIC))[:, 2:18]
    assert out.shape == (16, 16, 3)
    np.testing.assert_array_equal(out, expected)


def test_folder_images_are_sorted_and_cropped(tmp_path):
    (tmp_path / "sub").mkdir()
    Image.new("RGB", (40, 30), (255, 0, 0)).save(tmp_path / "b.png")
    Image.new("L", (20, 50), 128).save(tmp_path / "sub" / "c.png")
    Image.new("RGB", (16, 16), (0, 0, 255)).save(tmp_path / "a.jpg")
    (tmp_path / "notes.txt").write_text("not an image")
    images = folder_images(tmp_path, 16)
    assert images.shape == (3, 16, 16, 3) and images.dtype == np.uint8
    assert images[0, 8, 8, 2] > 200 and images[1, 8, 8, 0] > 200 and images[2, 8, 8, 1] == 128
    with pytest.raises(ValueError, match="size="):
        build_reference(tmp_path)


def test_build_reference_statistics_cover_every_image_while_arr_0_keeps_a_subset():
    batch = build_reference("digits", extractor=PixelExtractor(), keep_images=100)
    every = build_reference("digits").images
    assert every.shape == (1438, 8, 8, 1) and batch.images.shape == (100, 8, 8, 1)
    mu, sigma = feature_statistics(every.astype(np.float32).mean(axis=(2, 3)) / 255.0)
    np.testing.assert_allclose(batch.mu, mu, rtol=1e-5)
    np.testing.assert_allclose(batch.sigma, sigma, rtol=1e-4, atol=1e-9)
    assert batch.extractor == "pixels" and batch.sigma_s.shape == (64, 64)
    assert build_reference("digits", size=16).images.shape == (1438, 16, 16, 1)


def test_scorer_reports_every_metric_and_uses_spatial_features_for_sfid():
    scorer = GenerationScorer(PixelExtractor())
    # 64-d spatial features: sFID is computed only with >= 10 x 64 images in both sets
    reference, samples = _images(700, seed=1), _images(650, seed=2)
    result = scorer.score(samples, reference)
    assert set(result) == {"fid", "sfid", "sfid_note", "is", "precision", "recall", "class_agreement", "extractor",
                           "num_samples", "num_reference"}
    assert result["extractor"] == "pixels" and result["num_samples"] == 650 and result["num_reference"] == 700
    assert result["sfid_note"] is None and result["class_agreement"] is None
    spatial = [feature_statistics(x.astype(np.float32).reshape(len(x), -1) / 255.0) for x in (samples, reference)]
    assert result["sfid"] == pytest.approx(frechet_distance(*spatial[0], *spatial[1]), rel=1e-5)
    assert result["sfid"] != pytest.approx(result["fid"], rel=1e-3)
    same = scorer.score(reference, reference)
    assert abs(same["fid"]) < 1e-6 and same["precision"] == same["recall"] == 1.0


def test_scorer_uses_stored_statistics_only_from_its_own_extractor(caplog):
    scorer = GenerationScorer(PixelExtractor())
    images = _images(50, seed=3)
    stored = dict(mu=np.full(8, 0.5), sigma=np.eye(8), mu_s=np.full(64, 0.5), sigma_s=np.eye(64))
    own = scorer.reference_stats(ReferenceBatch(images=images, extractor="pixels", **stored))
    np.testing.assert_array_equal(own.mu, stored["mu"])
    with caplog.at_level(logging.WARNING):
        other = scorer.reference_stats(ReferenceBatch(images=images, extractor="inception", **stored))
    assert "recomputing" in caplog.text
    np.testing.assert_allclose(other.mu, images.astype(np.float32).mean(axis=(0, 2, 3)) / 255.0, rtol=1e-5)
    other_kind = dataclasses.replace(own, extractor="digits")
    with pytest.raises(ValueError, match="'digits' extractor"):
        scorer.score(images, other_kind)


def test_extractor_rejects_images_in_the_wrong_layout():
    with pytest.raises(ValueError, match="channels last"):
        PixelExtractor().extract(np.zeros((2, 3, 8, 8), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        PixelExtractor().extract(torch.zeros(2, 8, 8, 3))
