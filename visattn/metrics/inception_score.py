"""Inception score from classifier logits, as the ADM evaluator computes it (contiguous splits)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
from scipy.special import log_softmax, logsumexp

ADM_SPLIT_SIZE = 5000  # the ADM evaluator scores 50k samples as 10 contiguous splits of 5000


def inception_score(logits: np.ndarray, splits: int = 10, split_size: int | None = None) -> float:
    """Mean over contiguous splits of ``exp(E_x KL(p(y|x) || p(y)))``, for ``logits: [N, K]``.

    ``split_size`` (as in ADM: chunks of that many rows, the last one possibly shorter) overrides
    ``splits`` (that many near-equal chunks). Samples are never shuffled.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 2 or len(logits) == 0:
        raise ValueError(f"logits must be [N, K] with N >= 1; got shape {logits.shape}")
    if split_size is not None:
        if split_size < 1:
            raise ValueError(f"split_size={split_size} must be >= 1")
        bounds = list(range(0, len(logits), split_size)) + [len(logits)]
    else:
        if not 1 <= splits <= len(logits):
            raise ValueError(f"splits={splits} must be between 1 and the number of samples ({len(logits)})")
        bounds = [i * len(logits) // splits for i in range(splits + 1)]
    log_p = log_softmax(logits, axis=1)
    scores = []
    for start, stop in pairwise(bounds):
        part = log_p[start:stop]
        log_marginal = logsumexp(part, axis=0, keepdims=True) - np.log(len(part))  # log p(y), no underflow
        kl = np.sum(np.exp(part) * (part - log_marginal), axis=1).mean()
        scores.append(np.exp(kl))
    return float(np.mean(scores))
