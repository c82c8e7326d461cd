"""The Inception extractor: torch-fidelity's network with random weights, our sFID tap, weight lookup."""

import io
from unittest import mock

import numpy as np
import pytest
import torch
from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

from visattn.metrics import build_extractor
from visattn.metrics.inception import (
    INCEPTION_WEIGHTS_ENV,
    INCEPTION_WEIGHTS_NAME,
    InceptionExtractor,
    resolve_inception_weights,
)


def _random_inception(seed: int = 0) -> FeatureExtractorInceptionV3:
    """torch-fidelity's class with its default random initialisation (its weight loading skipped)."""
    empty = io.BytesIO()
    torch.save({}, empty)
    empty.seek(0)
    torch.manual_seed(seed)
    with mock.patch.object(FeatureExtractorInceptionV3, "load_state_dict", lambda self, state_dict: None):
        return FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=empty)


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("inception") / INCEPTION_WEIGHTS_NAME
    torch.save(_random_inception().state_dict(), path)
    return path


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # A 299x299 Inception forward takes 0.6 s on one thread and ~14 s on two oversubscribed ones.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def no_warm_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.delenv(INCEPTION_WEIGHTS_ENV, raising=False)


def test_missing_weights_give_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=INCEPTION_WEIGHTS_NAME) as info:
        build_extractor("inception")
    assert INCEPTION_WEIGHTS_ENV in str(info.value) and "--weights" in str(info.value)
    with pytest.raises(FileNotFoundError, match="nowhere.pth"):
        InceptionExtractor(tmp_path / "nowhere.pth")


def test_weights_are_found_through_env_and_torch_hub_cache(weights_file, tmp_path, monkeypatch):
    hub_file = tmp_path / "torch_home" / "hub" / "checkpoints" / INCEPTION_WEIGHTS_NAME
    hub_file.parent.mkdir(parents=True)
    hub_file.write_bytes(b"x")
    assert resolve_inception_weights() == hub_file
    monkeypatch.setenv(INCEPTION_WEIGHTS_ENV, str(weights_file))
    assert resolve_inception_weights() == weights_file


def test_features_match_torch_fidelity_and_sfid_taps_mixed_6d(weights_file):
    extractor = InceptionExtractor(weights_file)
    reference = FeatureExtractorInceptionV3(
        "inception-v3-compat", ["2048", "logits_unbiased"], feature_extractor_weights_path=str(weights_file)
    )
    mixed_6d = []
    reference.Mixed_6d.branch1x1.register_forward_hook(lambda m, i, out: mixed_6d.append(out.clone()))
    images = np.random.default_rng(0).integers(0, 256, size=(2, 32, 24, 3), dtype=np.uint8)

    features = extractor.extract(images)
    with torch.no_grad():
        pooled, logits = reference(torch.from_numpy(images).permute(0, 3, 1, 2).contiguous())

    assert features.pooled.shape == (2, 2048) and features.logits.shape == (2, 1008)
    assert features.spatial.shape == (2, 7 * 17 * 17)
    np.testing.assert_array_equal(features.pooled, pooled.numpy())
    np.testing.assert_array_equal(features.logits, logits.numpy())
    # ADM: mixed_6/conv[..., :7] of the NHWC map, flattened (channel fastest)
    expected = mixed_6d[0][:, :7].permute(0, 2, 3, 1).reshape(2, -1).numpy()
    np.testing.assert_array_equal(features.spatial, expected)
    assert np.abs(features.spatial).sum() > 0

    grey = extractor.extract(images[..., :1])
    rgb = extractor.extract(np.repeat(images[..., :1], 3, axis=-1))
    np.testing.assert_array_equal(grey.pooled, rgb.pooled)
