"""Gaussian diffusion with epsilon prediction and learned variance (improved DDPM, as DiT trains it).

Tensors: images or latents ``x: [B, C, H, W]``; steps ``t: [B]`` (int64, indices into this
process's steps). A model output is ``[B, 2C, H, W]`` (epsilon, then the variance values
``v`` in [-1, 1]) with ``learn_sigma``, else ``[B, C, H, W]`` with a fixed variance: beta_t
("fixed-large", what DiT's ``create_diffusion(learn_sigma=False)`` samples with) or, with
``sigma_small``, the posterior's ("fixed-small").
A respaced process (``respace``) keeps a subset of the original steps; its ``timestep_map`` gives
the original step index the model is conditioned on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .losses import discretized_gaussian_log_likelihood, normal_kl
from .schedule import linear_betas, space_timesteps

ModelFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x_t, model steps) -> output


def mean_flat(x: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B]: mean over every non-batch dimension."""
    return x.mean(dim=tuple(range(1, x.ndim)))


class GaussianDiffusion:
    """Forward process, posterior, model-parameterised reverse step and the hybrid training loss.

    Args:
        betas: [T] float64 noise schedule.
        learn_sigma: the model predicts the variance by interpolating (in log space) between the
            posterior variance and beta_t, as improved DDPM's ``learned_range``.
        timestep_map: [T] original step index of each step (identity for an unrespaced process).
        original_num_timesteps: T of the process the model was trained on (scales the VLB term).
        sigma_small: without ``learn_sigma``, sample with the posterior variance instead of
            DiT's default fixed-large one (improved DDPM's ``FIXED_SMALL`` / ``FIXED_LARGE``).
    """

    def __init__(
        self,
        betas: np.ndarray,
        learn_sigma: bool = True,
        timestep_map: Sequence[int] | None = None,
        original_num_timesteps: int | None = None,
        sigma_small: bool = False,
    ) -> None:
        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or not ((betas > 0) & (betas <= 1)).all():
            raise ValueError("betas must be a 1-D array with values in (0, 1]")
        self.betas = betas
        self.log_betas = np.log(betas)
        self.learn_sigma = learn_sigma
        self.sigma_small = sigma_small
        self.num_timesteps = len(betas)
        self.timestep_map = np.arange(len(betas)) if timestep_map is None else np.asarray(timestep_map)
        self.original_num_timesteps = original_num_timesteps or self.num_timesteps

        alphas = 1.0 - betas
        self.alphas_cumprod = np.cumprod(alphas)
        self.alphas_cumprod_prev = np.append(1.0, self.alphas_cumprod[:-1])
        self.sqrt_alphas_cumprod = np.sqrt(self.alphas_cumprod)
        self.sqrt_one_minus_alphas_cumprod = np.sqrt(1.0 - self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod)
        self.sqrt_recipm1_alphas_cumprod = np.sqrt(1.0 / self.alphas_cumprod - 1)
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        # The posterior variance is 0 at t = 0; its log is clipped to the t = 1 value.
        variance_1 = self.posterior_variance[1] if len(betas) > 1 else betas[0]
        self.posterior_log_variance_clipped = np.log(np.append(variance_1, self.posterior_variance[1:]))
        # Fixed-large: beta_t, except the posterior variance at t = 0 (beta_0 would be far too small
        # for the last step's noise; as improved DDPM, which DiT uses).
        self.fixed_large_variance = np.append(variance_1, betas[1:])
        self.fixed_large_log_variance = np.log(self.fixed_large_variance)
        self.posterior_mean_coef1 = betas * np.sqrt(self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - self.alphas_cumprod_prev) * np.sqrt(alphas) / (1.0 - self.alphas_cumprod)

    @classmethod
    def linear(cls, num_timesteps: int = 1000, learn_sigma: bool = True, sigma_small: bool = False) -> GaussianDiffusion:
        return cls(linear_betas(num_timesteps), learn_sigma, sigma_small=sigma_small)

    def respace(self, spacing: str | int) -> GaussianDiffusion:
        """A process over a subset of the steps (``space_timesteps``) with the same marginals
        q(x_t | x_0) at the kept steps; betas are recomputed from the kept alphas_cumprod."""
        kept = space_timesteps(self.num_timesteps, spacing)
        betas, last = [], 1.0
        for step in kept:
            betas.append(1.0 - self.alphas_cumprod[step] / last)
            last = self.alphas_cumprod[step]
        mapped = self.timestep_map[kept]
        return GaussianDiffusion(
            np.array(betas), self.learn_sigma, mapped, self.original_num_timesteps, sigma_small=self.sigma_small
        )

    # -- helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _at(values: np.ndarray, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """values[t] as float32 [B, 1, ..., 1] broadcastable to ``like``."""
        out = torch.from_numpy(values).to(device=t.device)[t].float()
        return out.view(-1, *([1] * (like.ndim - 1)))

    def model_timesteps(self, t: torch.Tensor) -> torch.Tensor:
        """Step indices of this process -> the original steps the model is conditioned on."""
        return torch.from_numpy(self.timestep_map).to(t.device)[t]

    # -- forward process and posterior -------------------------------------------------------------
    def q_sample(self, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """x_t ~ q(x_t | x_0) = N(sqrt(abar_t) x_0, (1 - abar_t) I)."""
        return self._at(self.sqrt_alphas_cumprod, t, x_start) * x_start + self._at(
            self.sqrt_one_minus_alphas_cumprod, t, x_start
        ) * noise

    def q_posterior(self, x_start: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor):
        """Mean, variance and clipped log variance of q(x_{t-1} | x_t, x_0)."""
        mean = self._at(self.posterior_mean_coef1, t, x_t) * x_start + self._at(self.posterior_mean_coef2, t, x_t) * x_t
        return mean, self._at(self.posterior_variance, t, x_t), self._at(self.posterior_log_variance_clipped, t, x_t)

    def predict_xstart(self, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        return self._at(self.sqrt_recip_alphas_cumprod, t, x_t) * x_t - self._at(self.sqrt_recipm1_alphas_cumprod, t, x_t) * eps

    def predict_eps(self, x_t: torch.Tensor, t: torch.Tensor, x_start: torch.Tensor) -> torch.Tensor:
        return (self._at(self.sqrt_recip_alphas_cumprod, t, x_t) * x_t - x_start) / self._at(
            self.sqrt_recipm1_alphas_cumprod, t, x_t
        )

    # -- reverse process ---------------------------------------------------------------------------
    def p_mean_variance(
        self, model_output: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, clip_denoised: bool = False
    ) -> dict[str, torch.Tensor]:
        """p(x_{t-1} | x_t) from a model output: ``mean``, ``variance``, ``log_variance``,
        ``pred_xstart``, ``eps`` (all [B, C, H, W] or broadcastable)."""
        model_output = model_output.float()
        C = x_t.shape[1]
        if self.learn_sigma:
            if model_output.shape[1] != 2 * C:
                raise ValueError(f"learn_sigma needs a model output of {2 * C} channels, got {model_output.shape[1]}")
            eps, v = model_output[:, :C], model_output[:, C:]
            min_log = self._at(self.posterior_log_variance_clipped, t, x_t)
            max_log = self._at(self.log_betas, t, x_t)
            frac = (v + 1) / 2
            log_variance = frac * max_log + (1 - frac) * min_log
            variance = torch.exp(log_variance)
        else:
            eps = model_output[:, :C]
            if self.sigma_small:
                fixed, fixed_log = self.posterior_variance, self.posterior_log_variance_clipped
            else:
                fixed, fixed_log = self.fixed_large_variance, self.fixed_large_log_variance
            variance = self._at(fixed, t, x_t).expand_as(x_t)
            log_variance = self._at(fixed_log, t, x_t).expand_as(x_t)
        pred_xstart = self.predict_xstart(x_t, t, eps)
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1, 1)
        mean, _, _ = self.q_posterior(pred_xstart, x_t, t)
        return {"mean": mean, "variance": variance, "log_variance": log_variance, "pred_xstart": pred_xstart, "eps": eps}

    # -- training ----------------------------------------------------------------------------------
    def vb_terms_bpd(self, model_output: torch.Tensor, x_start: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor):
        """Per-sample VLB term in bits per dimension: KL(q(x_{t-1}|x_t,x_0) || p(x_{t-1}|x_t)) for
        t > 0, the discretised decoder NLL at t = 0. Returns ([B], p_mean_variance dict)."""
        true_mean, _, true_log_var = self.q_posterior(x_start, x_t, t)
        out = self.p_mean_variance(model_output, x_t, t)
        kl = mean_flat(normal_kl(true_mean, true_log_var, out["mean"], out["log_variance"])) / math.log(2.0)
        nll = -discretized_gaussian_log_likelihood(x_start, out["mean"], 0.5 * out["log_variance"])
        nll = mean_flat(nll) / math.log(2.0)
        return torch.where(t == 0, nll, kl), out

    def training_losses(
        self, model_fn: ModelFn, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Hybrid loss per sample ([B] each): ``mse`` of the predicted noise, plus with learn_sigma the
        VLB term ``vb`` (the mean's gradient stopped, so it only trains the variance; scaled by
        T / 1000 as improved DDPM does, i.e. 1 for the 1000-step process) and ``loss`` = mse + vb."""
        noise = torch.randn_like(x_start) if noise is None else noise
        x_t = self.q_sample(x_start, t, noise)
        output = model_fn(x_t, self.model_timesteps(t)).float()
        C = x_start.shape[1]
        terms = {"mse": mean_flat((noise - output[:, :C]) ** 2)}
        if self.learn_sigma:
            frozen = torch.cat([output[:, :C].detach(), output[:, C:]], dim=1)
            vb, _ = self.vb_terms_bpd(frozen, x_start, x_t, t)
            terms["vb"] = vb * (self.original_num_timesteps / 1000.0)
            terms["loss"] = terms["mse"] + terms["vb"]
        else:
            terms["loss"] = terms["mse"]
        return terms
