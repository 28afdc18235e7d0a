"""An independent dense reference for tree attention (tests and the GPU script).

Written apart from the production math on purpose: float64, K/V expanded per query head with
``repeat_interleave``, and the visibility of every (query, key) pair decided by walking the
tree's parent pointers and comparing positions one pair at a time -- no shared mask
expression with ``vllm_recap.vllm.attention_math``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def visible(parents: Sequence[int], prefix: int, window: int = -1,
            prefix_start: int = 0) -> torch.Tensor:
    """[n, (prefix - prefix_start) + n] bool: what tree node i may attend to.

    Node i sits at position prefix + depth(i). It sees prefix keys at positions
    prefix_start..prefix-1 and the tree nodes on its root path (itself included); with a
    sliding window only keys at positions > position(i) - window.
    """
    n = len(parents)
    depth = []
    for i in range(n):
        depth.append(0 if parents[i] < 0 else depth[parents[i]] + 1)
    width = prefix - prefix_start
    out = torch.zeros(n, width + n, dtype=torch.bool)
    for i in range(n):
        pos_i = prefix + depth[i]
        on_path, j = set(), i
        while j >= 0:
            on_path.add(j)
            j = parents[j]
        for key in range(width):
            out[i, key] = window <= 0 or prefix_start + key > pos_i - window
        for j in range(n):
            out[i, width + j] = j in on_path and (window <= 0 or prefix + depth[j] > pos_i - window)
    return out


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    allowed: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """[n, H, D] float32: softmax attention of q [n, H, D] over keys/values [S, KVH, D]."""
    g = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(g, dim=1)  # [S, H, D]
    v = values.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("nhd,shd->hns", q.double(), k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hns,shd->nhd", torch.softmax(scores, -1), v).float()


def tree_reference(q: torch.Tensor, k_seq: torch.Tensor, v_seq: torch.Tensor,
                   parents: Sequence[int], prefix: int, scale: float, window: int = -1,
                   softcap: float = 0.0) -> torch.Tensor:
    """Tree attention of the nodes q [n, H, D] of a sequence whose K/V are k_seq, v_seq
    [prefix + n, KVH, D] (prefix tokens, then the nodes in layout order)."""
    return dense_attention(q, k_seq, v_seq, visible(list(parents), prefix, window), scale,
                           softcap)
