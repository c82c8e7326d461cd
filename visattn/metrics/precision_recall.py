"""Improved precision and recall (Kynkaeaenniemi et al. 2019) with k-NN manifold radii, as in ADM.

Each set's manifold is the union of balls around its points, the radius of a ball being the
distance to the point's k-th nearest neighbour within its own set (the point itself not counted).
Precision: fraction of generated points inside the real manifold; recall: fraction of real points
inside the generated manifold. Distances are computed block by block (``batch_size`` rows against
``batch_size`` columns), so 50k x 50k sets never hold more than one block of distances in memory.
"""

from __future__ import annotations

import numpy as np
import torch

DEFAULT_BATCH_SIZE = 5000


def _as_tensor(features: np.ndarray | torch.Tensor, device, dtype, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(np.asarray(features) if not torch.is_tensor(features) else features)
    if tensor.ndim != 2:
        raise ValueError(f"{name} must be [N, D]; got shape {tuple(tensor.shape)}")
    return tensor.to(device=device, dtype=dtype)


def _squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a: [n, D]``, ``b: [m, D]`` -> ``[n, m]`` squared euclidean distances (clamped at 0)."""
    sq = a.square().sum(1, keepdim=True) - 2.0 * (a @ b.T) + b.square().sum(1)
    return sq.clamp_min_(0.0)


def manifold_radii(
    features: torch.Tensor, k: int = 3, batch_size: int = DEFAULT_BATCH_SIZE
) -> torch.Tensor:
    """``features: [N, D]`` -> ``[N]`` squared distance of each point to its k-th nearest neighbour."""
    n = len(features)
    if n <= k:
        raise ValueError(f"k={k} nearest neighbours need more than k points; got {n}")
    radii = []
    for start in range(0, n, batch_size):
        rows = features[start : start + batch_size]
        nearest = None  # the k + 1 smallest distances seen so far per row (the row's own 0 included)
        for col in range(0, n, batch_size):
            block = _squared_distances(rows, features[col : col + batch_size])
            candidates = block if nearest is None else torch.cat([nearest, block], dim=1)
            nearest = candidates.topk(min(k + 1, candidates.shape[1]), dim=1, largest=False).values
        radii.append(nearest[:, k])
    return torch.cat(radii)


def precision_recall(
    real_features: np.ndarray | torch.Tensor,
    fake_features: np.ndarray | torch.Tensor,
    k: int = 3,
    batch_size: int = DEFAULT_BATCH_SIZE,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[float, float]:
    """``(precision, recall)`` of ``fake_features: [M, D]`` against ``real_features: [N, D]``."""
    real = _as_tensor(real_features, device, dtype, "real_features")
    fake = _as_tensor(fake_features, device, dtype, "fake_features")
    if real.shape[1] != fake.shape[1]:
        raise ValueError(f"feature widths differ: real {real.shape[1]} vs fake {fake.shape[1]}")
    real_radii = manifold_radii(real, k, batch_size)
    fake_radii = manifold_radii(fake, k, batch_size)
    fake_in_real = torch.zeros(len(fake), dtype=torch.bool, device=fake.device)
    real_in_fake = torch.zeros(len(real), dtype=torch.bool, device=real.device)
    for r0 in range(0, len(real), batch_size):
        for f0 in range(0, len(fake), batch_size):
            dist = _squared_distances(real[r0 : r0 + batch_size], fake[f0 : f0 + batch_size])
            fake_in_real[f0 : f0 + batch_size] |= (dist <= real_radii[r0 : r0 + batch_size, None]).any(0)
            real_in_fake[r0 : r0 + batch_size] |= (dist <= fake_radii[None, f0 : f0 + batch_size]).any(1)
    return fake_in_real.double().mean().item(), real_in_fake.double().mean().item()
