"""Class-conditional DiT: config checks and builders (``setup``), data and latent caches (``data``,
``latents``), the training loop (``training``), sampling and scores (``sampling``, ``evaluation``),
the entry ``run`` dispatching the modes (``trainer``)."""

from visattn.engine.dit.trainer import run

__all__ = ["run"]
