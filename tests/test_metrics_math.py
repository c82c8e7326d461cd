"""FID / IS / precision-recall math against closed forms and torch-fidelity's implementations."""

import numpy as np
import pytest
import torch
from scipy import linalg
from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
from torch_fidelity.metric_isc import isc_features_to_metric
from torch_fidelity.metric_prc import calculate_precision_recall_full

from visattn.metrics import feature_statistics, frechet_distance, inception_score, precision_recall


def _random_covariance(rng, dim):
    a = rng.normal(size=(dim, dim))
    return a @ a.T / dim + 0.1 * np.eye(dim)


def _closed_form_fid(m1, s1, m2, s2):
    root1 = linalg.sqrtm(s1).real
    return float(np.sum((m1 - m2) ** 2) + np.trace(s1 + s2 - 2 * linalg.sqrtm(root1 @ s2 @ root1).real))


def test_fid_of_a_set_with_itself_is_zero():
    features = np.random.default_rng(0).normal(size=(400, 16))
    mu, sigma = feature_statistics(features)
    assert abs(frechet_distance(mu, sigma, mu, sigma)) < 1e-8


def test_feature_statistics_are_mean_and_unbiased_covariance():
    features = np.random.default_rng(1).normal(size=(50, 3)).astype(np.float32)
    mu, sigma = feature_statistics(features)
    assert mu.dtype == np.float64 and sigma.shape == (3, 3)
    centred = features.astype(np.float64) - features.astype(np.float64).mean(0)
    np.testing.assert_allclose(sigma, centred.T @ centred / 49, rtol=1e-12)
    with pytest.raises(ValueError, match="N >= 2"):
        feature_statistics(features[:1])


def test_fid_of_gaussian_parameters_matches_closed_form():
    rng = np.random.default_rng(2)
    m1, m2 = rng.normal(size=6), rng.normal(size=6)
    s1, s2 = _random_covariance(rng, 6), _random_covariance(rng, 6)
    assert frechet_distance(m1, s1, m2, s2) == pytest.approx(_closed_form_fid(m1, s1, m2, s2), rel=1e-9)


def test_fid_of_gaussian_samples_approaches_closed_form():
    rng = np.random.default_rng(3)
    m1, m2 = np.zeros(4), np.array([1.0, -0.5, 0.0, 2.0])
    s1, s2 = np.diag([1.0, 2.0, 0.5, 1.0]), np.diag([0.25, 1.0, 1.0, 4.0])
    expected = _closed_form_fid(m1, s1, m2, s2)  # = 5.25 + sum (sqrt a - sqrt b)^2
    x = rng.multivariate_normal(m1, s1, size=40000)
    y = rng.multivariate_normal(m2, s2, size=40000)
    assert frechet_distance(*feature_statistics(x), *feature_statistics(y)) == pytest.approx(expected, rel=0.02)


def test_fid_equals_torch_fidelity_on_the_same_features():
    rng = np.random.default_rng(4)
    a = rng.normal(size=(300, 32))
    b = rng.normal(size=(200, 32)) * 1.3 + 0.2
    ours = frechet_distance(*feature_statistics(a), *feature_statistics(b))
    stats = [fid_features_to_statistics(torch.from_numpy(x)) for x in (a, b)]
    theirs = fid_statistics_to_metric(stats[0], stats[1], verbose=False)["frechet_inception_distance"]
    assert ours == pytest.approx(theirs, rel=1e-8)


def test_fid_survives_singular_covariances():
    rng = np.random.default_rng(5)
    a, b = rng.normal(size=(8, 20)), rng.normal(size=(8, 20))  # 8 samples in 20-d: rank 7
    value = frechet_distance(*feature_statistics(a), *feature_statistics(b))
    assert np.isfinite(value) and value > 0


def test_fid_rejects_large_imaginary_parts_and_mismatched_shapes():
    with pytest.raises(ValueError, match="imaginary component"):
        frechet_distance(np.zeros(2), np.eye(2), np.zeros(2), np.diag([-1.0, 1.0]))
    with pytest.raises(ValueError, match="different extractors"):
        frechet_distance(np.zeros(2), np.eye(2), np.zeros(3), np.eye(3))


def test_inception_score_of_uniform_logits_is_one():
    assert inception_score(np.zeros((100, 10))) == pytest.approx(1.0, abs=1e-12)


def test_inception_score_of_confident_evenly_spread_one_hots_is_the_class_count():
    logits = 100.0 * np.eye(10)[np.arange(1000) % 10]
    assert inception_score(logits, splits=10) == pytest.approx(10.0, rel=1e-9)


def test_inception_score_splits_are_contiguous_not_shuffled():
    # Sorted by class, every contiguous split holds one class only: IS 1 (shuffled splits would give ~10).
    logits = 100.0 * np.eye(10)[np.repeat(np.arange(10), 100)]
    assert inception_score(logits, splits=10) == pytest.approx(1.0, abs=1e-9)


def test_inception_score_equals_torch_fidelity_without_shuffling():
    logits = np.random.default_rng(6).normal(scale=3.0, size=(500, 20))
    theirs = isc_features_to_metric(torch.from_numpy(logits), splits=5, shuffle=False)["inception_score_mean"]
    assert inception_score(logits, splits=5) == pytest.approx(theirs, rel=1e-10)


def test_inception_score_split_size_chunks_like_adm():
    logits = np.random.default_rng(7).normal(scale=3.0, size=(1200, 8))
    chunks = [logits[:500], logits[500:1000], logits[1000:]]  # ADM: fixed-size chunks, last one short
    expected = np.mean([inception_score(c, splits=1) for c in chunks])
    assert inception_score(logits, split_size=500) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="splits=0"):
        inception_score(logits, splits=0)


def test_precision_recall_of_a_set_with_itself_is_one_and_far_shift_zero():
    x = np.random.default_rng(8).normal(size=(200, 8))
    assert precision_recall(x, x) == (1.0, 1.0)
    assert precision_recall(x, x + 1000.0) == (0.0, 0.0)


@pytest.mark.parametrize("batch_size", [5000, 37])
def test_precision_recall_equals_torch_fidelity(batch_size):
    rng = np.random.default_rng(9)
    real = rng.normal(size=(300, 6))
    fake = rng.normal(size=(250, 6)) + 1.0  # partial overlap: neither 0 nor 1
    precision, recall = precision_recall(real, fake, k=3, batch_size=batch_size)
    theirs = calculate_precision_recall_full(torch.from_numpy(fake), torch.from_numpy(real), neighborhood=3)
    assert 0.05 < precision < 0.95 and 0.05 < recall < 0.95
    assert (precision, recall) == pytest.approx(theirs, abs=1e-6)  # theirs: float32 means


def test_precision_recall_rejects_bad_inputs():
    x = np.zeros((3, 4))
    with pytest.raises(ValueError, match="more than k points"):
        precision_recall(x, x, k=3)
    with pytest.raises(ValueError, match="feature widths differ"):
        precision_recall(np.zeros((10, 4)), np.zeros((10, 5)))
