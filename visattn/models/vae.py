"""Stable Diffusion's VAE (diffusers ``AutoencoderKL``) as DiT's latent codec, from local files only.

Images ``[B, 3, H, W]`` in [-1, 1] <-> latents ``[B, 4, H/8, W/8]``. Latents the diffusion model
sees are the posterior sample times ``scale`` (0.18215 for the SD VAEs), as in DiT.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

SD_VAE_SCALE = 0.18215
SD_VAE_REPO = "stabilityai/sd-vae-ft-ema"


def _missing(path: str | None, repo: str) -> FileNotFoundError:
    where = f"vae.path={path} (a folder with config.json and diffusion_pytorch_model.safetensors)" if path else (
        f"the Hugging Face cache (repo {repo}, looked up with local_files_only=True)"
    )
    return FileNotFoundError(
        f"SD VAE not found in {where}. Nothing is downloaded at run time: on a machine with internet run "
        f"`python -c \"from diffusers import AutoencoderKL; AutoencoderKL.from_pretrained('{repo}')"
        f".save_pretrained('sd-vae-ft-ema')\"` and pass vae.path=/path/to/sd-vae-ft-ema, or copy the "
        f"huggingface cache (models--{repo.replace('/', '--')}) into ~/.cache/huggingface/hub."
    )


DECODE_BATCH = 32  # latents per decoder call (DiT's sample.py decodes its per-process batch of 32)


class SDVAE(nn.Module):
    """Frozen ``AutoencoderKL`` with DiT's latent scaling."""

    def __init__(self, autoencoder: nn.Module, scale: float = SD_VAE_SCALE) -> None:
        super().__init__()
        self.autoencoder = autoencoder.eval().requires_grad_(False)
        self.scale = scale

    @property
    def latent_channels(self) -> int:
        return int(self.autoencoder.config.latent_channels)

    @property
    def downsample(self) -> int:
        """Image side / latent side."""
        return 2 ** (len(self.autoencoder.config.block_out_channels) - 1)

    @torch.no_grad()
    def encode_moments(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """images: [B, 3, H, W] in [-1, 1] -> unscaled posterior (mean, std), each [B, 4, H/8, W/8]."""
        posterior = self.autoencoder.encode(images).latent_dist
        return posterior.mean, posterior.std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents [B, 4, h, w] -> images [B, 3, 8h, 8w] in about [-1, 1], ``DECODE_BATCH`` at a
        time: the decoder's activations at full resolution are what limits memory (sampling a batch of
        256 at 256 px, decoded at once, peaked at 62 GB on an H200), and each image decodes on its own."""
        return torch.cat([
            self.autoencoder.decode(chunk / self.scale).sample for chunk in latents.split(DECODE_BATCH)
        ])


def load_sd_vae(
    path: str | Path | None = None, repo: str = SD_VAE_REPO, scale: float = SD_VAE_SCALE,
    device: torch.device | str = "cpu",
) -> SDVAE:
    """The VAE from a local diffusers folder (``path``) or the Hugging Face cache (``repo``), never
    the network; a clear FileNotFoundError when absent."""
    from diffusers import AutoencoderKL

    if path is not None:
        if not (Path(path) / "config.json").is_file():
            raise _missing(str(path), repo)
        source = str(path)
    else:
        source = repo
    try:
        autoencoder = AutoencoderKL.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        raise _missing(str(path) if path else None, repo) from err
    return SDVAE(autoencoder, scale).to(device)
