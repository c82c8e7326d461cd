"""Noise schedules and timestep respacing (float64 numpy, as the improved-DDPM formulas are stated)."""

from __future__ import annotations

import numpy as np


def linear_betas(num_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02) -> np.ndarray:
    """DDPM's linear schedule, stretched so any ``num_timesteps`` spans the same noise range as 1000."""
    if num_timesteps < 1:
        raise ValueError(f"num_timesteps={num_timesteps} must be >= 1")
    scale = 1000 / num_timesteps
    return np.linspace(scale * beta_start, scale * beta_end, num_timesteps, dtype=np.float64)


def space_timesteps(num_timesteps: int, spacing: str | int) -> list[int]:
    """Steps of the original process kept by a respaced sampler, sorted ascending.

    ``spacing``: an int or a string of comma-separated counts, one per equal section of the
    process (``"250"``: 250 steps evenly over [0, T-1], ends included, rounded to integers;
    ``"10,15"``: 10 in the first half, 15 in the second); or ``"ddimN"``: the fixed stride that
    gives exactly N steps starting at 0 (DDIM's spacing).
    """
    text = str(spacing).strip()
    if text.startswith("ddim"):
        target = int(text[4:])
        for stride in range(1, num_timesteps):
            if len(range(0, num_timesteps, stride)) == target:
                return list(range(0, num_timesteps, stride))
        raise ValueError(f"spacing={spacing!r}: no integer stride gives exactly {target} of {num_timesteps} steps")
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"spacing={spacing!r} must be an int, comma-separated ints, or 'ddimN'") from None
    size_per, extra = divmod(num_timesteps, len(counts))
    kept: list[int] = []
    start = 0
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        if not 1 <= count <= size:
            raise ValueError(f"spacing={spacing!r}: cannot take {count} steps from a section of {size}")
        stride = (size - 1) / (count - 1) if count > 1 else 1.0
        position = 0.0
        for _ in range(count):  # accumulated, not j * stride: the same rounding as improved DDPM
            kept.append(start + round(position))
            position += stride
        start += size
    return sorted(set(kept))
