"""Ancestral (DDPM) and DDIM sampling with one random generator per sample.

Every random draw of sample ``i`` (its initial noise and the noise of each step) comes from its
own generator, seeded from ``(seed, i)``; so a sample does not depend on which batch or process
it is drawn in, and a set of N samples is the same on one process or many.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm

from .gaussian import GaussianDiffusion, ModelFn

SAMPLERS = ("ddpm", "ddim")


def sample_generators(seed: int, indices: Sequence[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per global sample index; the seed of index i is a fixed function of (seed, i)."""
    gens = []
    for i in indices:
        g = torch.Generator(device=device)
        g.manual_seed((int(seed) * 1_000_003 + int(i)) % (2**63 - 1))
        gens.append(g)
    return gens


def per_sample_randn(shape: Sequence[int], generators: Sequence[torch.Generator], device) -> torch.Tensor:
    """[len(generators), *shape] standard normal noise, row i drawn from generators[i]."""
    return torch.stack([torch.randn(tuple(shape), generator=g, device=device) for g in generators])


@torch.no_grad()
def sample_loop(
    diffusion: GaussianDiffusion,
    model_fn: ModelFn,
    shape: Sequence[int],
    generators: Sequence[torch.Generator],
    device: torch.device | str,
    method: str = "ddpm",
    eta: float = 0.0,
    clip_denoised: bool = False,
    progress: bool = False,
) -> torch.Tensor:
    """Draw ``len(generators)`` samples of per-sample ``shape`` [C, H, W] -> [B, C, H, W].

    Sample i's initial noise and every step's noise come from ``generators[i]`` (see
    ``denoise_loop`` for the update).
    """
    x_T = per_sample_randn(shape, generators, device)
    return denoise_loop(
        diffusion, model_fn, x_T, lambda _step: per_sample_randn(shape, generators, device),
        method, eta, clip_denoised, progress,
    )


@torch.no_grad()
def denoise_loop(
    diffusion: GaussianDiffusion,
    model_fn: ModelFn,
    x_T: torch.Tensor,
    step_noise: Callable[[int], torch.Tensor],
    method: str = "ddpm",
    eta: float = 0.0,
    clip_denoised: bool = False,
    progress: bool = False,
) -> torch.Tensor:
    """Run the reverse process from ``x_T: [B, C, H, W]`` down to step 0 -> x_0 [B, C, H, W].

    ``model_fn(x_t, model_steps)`` returns the model output for this process's steps already mapped
    to the original ones. ``step_noise(i)`` gives the noise [B, C, H, W] of step i; it is called
    once per step, from the last step down to 0 (step 0's noise is drawn and not used, as improved
    DDPM's ``p_sample_loop`` draws it), so a recorded noise sequence replays a reference run.
    ``ddpm``: ancestral sampling with the model's variance; ``ddim``: the DDIM update with ``eta``
    (0 = deterministic) on the same (usually respaced) process.
    """
    if method not in SAMPLERS:
        raise ValueError(f"sampler {method!r} is not known; use one of {SAMPLERS}")
    x = x_T
    steps = range(diffusion.num_timesteps - 1, -1, -1)
    for i in tqdm(steps, desc=f"{method} sampling", disable=not progress, leave=False):
        t = torch.full((x.shape[0],), i, dtype=torch.long, device=x.device)
        out = diffusion.p_mean_variance(model_fn(x, diffusion.model_timesteps(t)), x, t, clip_denoised)
        noise = step_noise(i)
        keep_noise = 0.0 if i == 0 else 1.0
        if method == "ddpm":
            x = out["mean"] + keep_noise * torch.exp(0.5 * out["log_variance"]) * noise
        else:
            x = ddim_step(diffusion, out, x, t, eta, noise * keep_noise)
    return x


def ddim_step(
    diffusion: GaussianDiffusion, out: dict[str, torch.Tensor], x_t: torch.Tensor, t: torch.Tensor,
    eta: float, noise: torch.Tensor,
) -> torch.Tensor:
    """x_{t-1} = sqrt(abar_prev) x0 + sqrt(1 - abar_prev - sigma^2) eps + sigma * noise (DDIM, eq. 12)."""
    eps = diffusion.predict_eps(x_t, t, out["pred_xstart"])
    abar = diffusion._at(diffusion.alphas_cumprod, t, x_t)
    abar_prev = diffusion._at(diffusion.alphas_cumprod_prev, t, x_t)
    sigma = eta * torch.sqrt((1 - abar_prev) / (1 - abar)) * torch.sqrt(1 - abar / abar_prev)
    mean = out["pred_xstart"] * torch.sqrt(abar_prev) + torch.sqrt(1 - abar_prev - sigma**2) * eps
    return mean + sigma * noise
