"""Gaussian diffusion for DiT: linear schedule, epsilon + learned variance, hybrid loss, respaced
DDPM / DDIM sampling with per-sample seeds, classifier-free guidance.

Written from the DDPM / improved-DDPM / DDIM formulas in float64, rather than on diffusers'
schedulers: ``DDPMScheduler`` computes its schedule in float32 and has no variational-bound loss
nor respacing that keeps a learned variance consistent; the tests cross-check our learned-range
variance against ``DDPMScheduler(variance_type="learned_range")``.
"""

from .gaussian import GaussianDiffusion, mean_flat
from .guidance import DIT_GUIDED_CHANNELS, check_guided_channels, conditional_fn, guided_fn, sampling_fn
from .losses import discretized_gaussian_log_likelihood, normal_kl
from .sampling import SAMPLERS, denoise_loop, per_sample_randn, sample_generators, sample_loop
from .schedule import linear_betas, space_timesteps

__all__ = [
    "DIT_GUIDED_CHANNELS",
    "SAMPLERS",
    "GaussianDiffusion",
    "check_guided_channels",
    "conditional_fn",
    "denoise_loop",
    "discretized_gaussian_log_likelihood",
    "guided_fn",
    "linear_betas",
    "mean_flat",
    "normal_kl",
    "per_sample_randn",
    "sample_generators",
    "sample_loop",
    "sampling_fn",
    "space_timesteps",
]
