"""Row fusion, paper eqs. 4-6, as a pure function over the same compiled code the tree uses.

For a context h with r available rows P_1..P_r (G, C, U order, most specific first):

    c_j = exp(-H(P_j))                       H = entropy of the K-sparse distribution
    w_j = a_j c_j / sum_i a_i c_i            a_j = priors[j]: prior by rank among available rows
    m(z) = sum_j w_j P_j(z)
    q(z|h) = m(z) / sum_{v in S(h)} m(v)     S(h) = top-K of m

Ablations: BACKOFF (w = [1, 0, 0]), UNIFORM (w_j = 1/r), PRIORS_FIXED (w_j proportional to a_j).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_recap.core import _kernels as kernels
from vllm_recap.core.config import FusionMode

FUSION_CODES = {
    FusionMode.PRIORS_ENTROPY: kernels.FUSE_PRIORS_ENTROPY,
    FusionMode.BACKOFF: kernels.FUSE_BACKOFF,
    FusionMode.UNIFORM: kernels.FUSE_UNIFORM,
    FusionMode.PRIORS_FIXED: kernels.FUSE_PRIORS_FIXED,
}


@dataclass(frozen=True)
class Fused:
    """Result of `fuse`.

    Attributes:
        ids: [m] int64 candidate ids S(h), by q descending (m <= k).
        q: [m] float64, sums to 1 (empty when no row was given).
        weights: [r] float64 row weights w_j, summing to 1.
    """

    ids: np.ndarray
    q: np.ndarray
    weights: np.ndarray


def row_confidence(probs: np.ndarray) -> np.ndarray:
    """c = exp(-H(P)) per row, H in nats over the K-sparse distribution.

    Args:
        probs: [..., K] non-negative; normalised here.

    Returns:
        [...] float64 in [1/K, 1].
    """
    p = np.asarray(probs, np.float64)
    p = p / p.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    return np.exp(plogp.sum(axis=-1))


def fuse(
    ids: np.ndarray,
    probs: np.ndarray,
    mode: FusionMode = FusionMode.PRIORS_ENTROPY,
    priors: tuple[float, float, float] = (0.70, 0.20, 0.10),
    k: int | None = None,
) -> Fused:
    """Fuses r <= 3 rows, most specific first, exactly as the tree builder does.

    Rows are normalised and stored as float32 first, like the memories store them, so results
    match the builder bit for bit.

    Args:
        ids: [r, K] int token ids per row (r in 0..3).
        probs: [r, K] non-negative weights per row (renormalised to sum to 1).
        mode: fusion rule.
        priors: a_1..a_3.
        k: candidates kept (default K).
    """
    ids = np.asarray(ids, np.int32)
    probs = np.asarray(probs, np.float64)
    if ids.ndim != 2 or ids.shape != probs.shape or ids.shape[0] > 3:
        raise ValueError(f"ids and probs must both be [r <= 3, K], got {ids.shape}, {probs.shape}")
    r, width = ids.shape
    k = width if k is None else k
    # The same float32 records the memories hold: ids | probs | conf.
    rows = np.zeros((r, 2 * width + 1), np.float32)
    if r:
        rows[:, :width] = ids
        rows[:, width : 2 * width] = probs / probs.sum(axis=1, keepdims=True)
        rows[:, 2 * width] = row_confidence(rows[:, width : 2 * width])
    out_ids, out_q, out_w, n = kernels.fuse_rows(rows, FUSION_CODES[mode],
                                           np.asarray(priors, np.float64), k)
    return Fused(out_ids[:n], out_q[:n], out_w[:r])
