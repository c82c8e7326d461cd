"""Sampling at GPU speed (issue 31, item 4), checked on CPU: ``sample.amp`` puts the model's forwards
(and only them) under bf16 autocast, ``auto`` picks bf16 on CUDA with bf16 and fp32 elsewhere,
``sample.compile`` samples like eager, the settings are validated and recorded, and the cfg pair
is one forward of the doubled batch."""

import json
import re

import numpy as np
import pytest
import torch
from test_engine_faults import dit_cfg  # the tiny DiT config of the fault tests

from visattn.diffusion import GaussianDiffusion, sampling_fn
from visattn.engine.amp import sampling_amp
from visattn.engine.dit.sampling import generate
from visattn.engine.dit.trainer import run as run_dit
from visattn.models.dit import DiT

CPU = torch.device("cpu")
SAMPLE = {"batch_size": 4, "cfg_scale": 1.5, "sampler": "ddim", "eta": 0.0}


def random_dit() -> DiT:
    model = DiT(input_size=4, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2, num_classes=3)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def sample(model, **settings):
    diffusion = GaussianDiffusion.linear(1000).respace("6")
    return generate(model, diffusion, lambda x: x.clamp(-1, 1), list(range(4)), 5, {**SAMPLE, **settings}, CPU)[0]


def test_auto_is_bf16_on_cuda_with_bf16_and_fp32_elsewhere(monkeypatch):
    assert sampling_amp("auto", CPU) == "none" and sampling_amp("bf16", CPU) == "bf16"
    assert sampling_amp("none", "cuda") == "none"
    for supported, expected in ((True, "bf16"), (False, "none")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, s=supported: s)
        assert sampling_amp("auto", "cuda") == expected
    with pytest.raises(ValueError, match=re.escape("sample.amp='fp16' is not known; use one of auto|bf16|none")):
        sampling_amp("fp16", CPU)


def test_bf16_sampling_puts_only_the_models_forwards_under_autocast():
    model = random_dit()
    seen = []
    model.register_forward_hook(lambda m, args, out: seen.append(
        (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), out.dtype)))
    fp32 = sample(model, amp="none")
    assert seen and all(not on and dtype == torch.float32 for on, _, dtype in seen)
    seen.clear()
    bf16 = sample(model, amp="bf16")
    assert seen and all(on and cast == torch.bfloat16 and dtype == torch.bfloat16 for on, cast, dtype in seen)
    assert bf16.dtype == np.uint8 and bf16.shape == fp32.shape
    assert not np.array_equal(bf16, fp32)  # the forwards really ran in bf16 ...
    assert np.abs(bf16.astype(int) - fp32.astype(int)).mean() < 8  # ... and the sampler stayed the same
    assert np.array_equal(sample(model, amp="auto"), fp32)  # on CPU auto is fp32: the same samples


def test_sample_compile_samples_like_eager(monkeypatch):
    model = random_dit()
    backends = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: backends.append(kw.get("backend")) or real(m, **kw))
    eager = sample(model)
    compiled = sample(model, compile="aot_eager")
    assert backends == ["aot_eager"]
    assert np.abs(compiled.astype(int) - eager.astype(int)).max() <= 1  # float rounding at a .5 boundary


def test_the_guided_pair_is_one_forward_of_the_doubled_batch():
    model = random_dit()
    batches = []
    model.register_forward_hook(lambda m, args, out: batches.append(args[0].shape[0]))
    x, t, y = torch.randn(3, 4, 4, 4), torch.full((3,), 5), torch.tensor([0, 1, 2])
    sampling_fn(model, y, 4.0)(x, t)
    assert batches == [6]


def test_sampling_settings_are_validated_and_recorded(tmp_path):
    with pytest.raises(ValueError, match="sample.amp='half' is not known"):
        run_dit(dit_cfg("train.steps=1", "sample.amp=half"), tmp_path / "a")
    with pytest.raises(ValueError, match="sample.compile=3 must be true, false or a torch.compile backend"):
        run_dit(dit_cfg("train.steps=1", "sample.compile=3"), tmp_path / "b")
    results = run_dit(dit_cfg("train.steps=1", "sample.amp=bf16", "eval.enabled=true", "eval.num_samples=4",
                              "sample.steps=2"), tmp_path / "c")
    saved = json.loads((tmp_path / "c" / "results.json").read_text())
    assert results["sample_amp"] == saved["sample_amp"] == "bf16"
    assert saved["sample_compile"] is False and saved["tf32"] is False
    sampled = run_dit(dit_cfg("mode=sample", f"ckpt={tmp_path / 'c'}", "sample.num_samples=2", "sample.steps=2",
                              "sample.compile=aot_eager"), tmp_path / "d")
    assert (sampled["sample_amp"], sampled["sample_compile"], sampled["tf32"]) == ("none", "aot_eager", False)
    assert sampled["sample_images_per_s"] > 0 and sampled["sampling_steps"] == 2
