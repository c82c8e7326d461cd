"""Diffusion: schedule and respacing, learned variance, the hybrid loss, guidance, per-sample seeds."""

import math

import numpy as np
import pytest
import torch

from visattn.diffusion import (
    GaussianDiffusion,
    discretized_gaussian_log_likelihood,
    guided_fn,
    normal_kl,
    sampling_fn,
    space_timesteps,
)
from visattn.engine.dit.sampling import generate
from visattn.models.dit import DiT


def test_linear_schedule_and_respacing():
    base = GaussianDiffusion.linear(1000)
    assert base.betas[0] == pytest.approx(1e-4) and base.betas[-1] == pytest.approx(0.02)
    kept = space_timesteps(1000, "250")
    assert len(kept) == 250 and kept[:3] == [0, 4, 8] and kept[-1] == 999
    assert space_timesteps(1000, "ddim50") == list(range(0, 1000, 20))
    assert space_timesteps(100, "3,2") == [0, 24, 49, 50, 99]
    spaced = base.respace("250")
    np.testing.assert_allclose(spaced.alphas_cumprod, base.alphas_cumprod[kept], rtol=1e-12)
    assert list(spaced.timestep_map) == kept
    with pytest.raises(ValueError, match="cannot take 30 steps"):
        space_timesteps(20, "30")


def test_learned_variance_matches_diffusers_learned_range():
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", variance_type="learned_range")
    diffusion = GaussianDiffusion.linear(1000)
    x = torch.zeros(1, 1, 1, 1)
    for step, v in [(1, -0.9), (10, 0.3), (500, -0.2), (999, 1.0)]:
        out = diffusion.p_mean_variance(torch.cat([x, torch.full_like(x, v)], 1), x, torch.tensor([step]))
        expected = float(scheduler._get_variance(step, predicted_variance=torch.tensor(v)))
        assert float(out["log_variance"]) == pytest.approx(expected, rel=1e-4)


def test_posterior_is_the_gaussian_product():
    d = GaussianDiffusion.linear(1000)
    g = torch.Generator().manual_seed(0)
    x0, xt = torch.randn(2, 1, 2, 2, generator=g), torch.randn(2, 1, 2, 2, generator=g)
    t = torch.tensor([3, 700])
    mean, var, _ = d.q_posterior(x0, xt, t)
    for i, step in enumerate(t.tolist()):
        # q(x_{t-1}|x_0) = N(sqrt(abar') x0, 1-abar'), q(x_t|x_{t-1}) = N(sqrt(a) x, beta): product of Gaussians.
        abar_prev, beta = d.alphas_cumprod_prev[step], d.betas[step]
        prec = 1 / (1 - abar_prev) + (1 - beta) / beta
        m = (math.sqrt(abar_prev) * x0[i] / (1 - abar_prev) + math.sqrt(1 - beta) * xt[i] / beta) / prec
        torch.testing.assert_close(mean[i], m.float(), rtol=1e-5, atol=1e-5)
        assert float(var[i]) == pytest.approx(1 / prec, rel=1e-6)


def test_likelihood_terms():
    m1, m2 = torch.tensor([0.3]), torch.tensor([-0.2])
    lv1, lv2 = torch.tensor([-1.0]), torch.tensor([0.5])
    ref = torch.distributions.kl_divergence(
        torch.distributions.Normal(m1, lv1.mul(0.5).exp()), torch.distributions.Normal(m2, lv2.mul(0.5).exp())
    )
    torch.testing.assert_close(normal_kl(m1, lv1, m2, lv2), ref)
    # The 256 discretised bins of [-1, 1] hold all the probability mass.
    levels = torch.linspace(-1, 1, 256)
    probs = discretized_gaussian_log_likelihood(levels, torch.tensor(0.1), torch.tensor(math.log(0.3))).exp()
    assert float(probs.sum()) == pytest.approx(1.0, abs=2e-3)


def test_hybrid_loss_terms_and_stopped_mean_gradient():
    d = GaussianDiffusion.linear(1000)
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(4, 2, 4, 4, generator=g) * 2 - 1
    noise = torch.randn(4, 2, 4, 4, generator=g)
    t = torch.tensor([0, 10, 500, 999])
    output = torch.randn(4, 4, 4, 4, generator=g).requires_grad_(True)
    terms = d.training_losses(lambda x, ts: output, x0, t, noise)
    torch.testing.assert_close(terms["mse"], ((noise - output[:, :2]) ** 2).mean(dim=(1, 2, 3)))
    torch.testing.assert_close(terms["loss"], terms["mse"] + terms["vb"])
    terms["vb"].sum().backward()
    assert torch.count_nonzero(output.grad[:, :2]) == 0  # the VLB trains only the variance channels
    assert torch.count_nonzero(output.grad[:, 2:]) > 0


def _random_dit(**kw):
    kw = {"input_size": 4, "patch_size": 2, "in_channels": 4, "hidden_size": 32, "depth": 2, "num_heads": 2,
          "num_classes": 3, **kw}
    model = DiT(**kw)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def test_classifier_free_guidance():
    model = _random_dit()
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(2, 4, 4, 4, generator=g), torch.tensor([5, 600]), torch.tensor([0, 2])
    cond, uncond = model(x, t, y), model(x, t, torch.full_like(y, 3))
    torch.testing.assert_close(guided_fn(model, y, 1.0)(x, t), cond, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sampling_fn(model, y, 1.0)(x, t), cond, rtol=0, atol=0)
    full = guided_fn(model, y, 4.0, guided_channels=None)(x, t)
    torch.testing.assert_close(full[:, :4], uncond[:, :4] + 4.0 * (cond[:, :4] - uncond[:, :4]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(full[:, 4:], cond[:, 4:], rtol=1e-5, atol=1e-5)
    quirk = guided_fn(model, y, 4.0)(x, t)  # the default: DiT's first 3 channels
    torch.testing.assert_close(quirk[:, :3], full[:, :3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(quirk[:, 3:], cond[:, 3:], rtol=1e-5, atol=1e-5)  # channel 3 unguided
    assert not torch.allclose(quirk[:, 3], full[:, 3])


def test_dit_guidance_slices_model_output_channels_like_forward_with_cfg():
    """One input channel with a learned variance: DiT's ``model_out[:, :3]`` takes the epsilon AND
    the variance channel; ``guided_channels=None`` guides the epsilon channel only."""
    model = _random_dit(in_channels=1)
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(2, 1, 4, 4, generator=g), torch.tensor([5, 600]), torch.tensor([0, 2])
    cond, uncond = model(x, t, y), model(x, t, torch.full_like(y, 3))
    dit = guided_fn(model, y, 2.0)(x, t)
    torch.testing.assert_close(dit, uncond + 2.0 * (cond - uncond), rtol=1e-5, atol=1e-5)
    standard = guided_fn(model, y, 2.0, guided_channels=None)(x, t)
    torch.testing.assert_close(standard[:, 1:], cond[:, 1:], rtol=1e-5, atol=1e-5)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"guided_channels={bad!r} must be a positive int"):
            sampling_fn(model, y, 2.0, guided_channels=bad)


@pytest.mark.parametrize("method", ["ddpm", "ddim"])
def test_samples_do_not_depend_on_batching_or_process_count(method):
    model = _random_dit()
    diffusion = GaussianDiffusion.linear(1000).respace("8")
    cfg = {"batch_size": 5, "cfg_scale": 1.5, "sampler": method, "eta": 0.5}
    decode = lambda x: x.clamp(-1, 1)  # noqa: E731
    one, labels = generate(model, diffusion, decode, list(range(6)), 7, cfg, torch.device("cpu"))
    # Two processes: rank r draws indices r, r + 2, ...; each with its own batch size.
    shards = {r: generate(model, diffusion, decode, list(range(r, 6, 2)), 7, {**cfg, "batch_size": 2 + r},
                          torch.device("cpu")) for r in (0, 1)}
    merged = np.empty_like(one)
    merged[0::2], merged[1::2] = shards[0][0], shards[1][0]
    assert np.abs(merged.astype(int) - one.astype(int)).max() <= 1  # float rounding at a .5 boundary
    assert (merged == one).mean() > 0.99
    assert list(shards[0][1]) == list(labels[0::2]) and list(shards[1][1]) == list(labels[1::2])
    other, _ = generate(model, diffusion, decode, list(range(6)), 8, cfg, torch.device("cpu"))
    assert not np.array_equal(other, one)
