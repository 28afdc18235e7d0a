"""Masked attention of draft-tree nodes: each node sees the committed prefix, its ancestors
and itself. Reference math shared by the CPU and CUDA backends and by the tests.
"""
from __future__ import annotations

import torch


def tree_attention(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
                   k_tree: torch.Tensor, v_tree: torch.Tensor, ancestor_mask: torch.Tensor,
                   scale: float, *, node_positions: torch.Tensor | None = None,
                   sliding_window: int = -1, softcap: float = 0.0) -> torch.Tensor:
    """Attention of n tree nodes over P prefix tokens plus the tree itself, in float32.

    Args:
        q: [n, H, D] queries of the nodes (rotary already applied at prefix + depth).
        k_prefix, v_prefix: [P, KVH, D] the committed prefix (positions 0..P-1).
        k_tree, v_tree: [n, KVH, D] the nodes' own keys/values.
        ancestor_mask: [n, n] bool, [i, j] = j is i or an ancestor of i.
        scale: softmax scale.
        node_positions: [n] positions of the nodes; needed with a sliding window.
        sliding_window: keys with position <= node position - window are masked (-1: none).
        softcap: if > 0, scores become softcap * tanh(scores / softcap).

    Returns:
        [n, H, D] in q's dtype.
    """
    n, h, d = q.shape
    kvh = k_tree.shape[1]
    g = h // kvh
    p = k_prefix.shape[0]
    # One batched matmul per KV head: the G query heads sharing it are folded into rows
    # (row = head-in-group * n + node), so K/V are never expanded per query head.
    keys = torch.cat([k_prefix, k_tree]).float().transpose(0, 1)  # [KVH, S, D]
    values = torch.cat([v_prefix, v_tree]).float().transpose(0, 1)
    qf = q.float().view(n, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * n, d)
    scores = torch.bmm(qf, keys.transpose(1, 2)).mul_(scale)  # [KVH, G*n, S]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = torch.ones(n, p + n, dtype=torch.bool, device=q.device)
    allowed[:, p:] = ancestor_mask
    if sliding_window > 0:
        assert node_positions is not None
        key_pos = torch.arange(p + n, device=q.device)
        key_pos[p:] = node_positions
        allowed &= key_pos[None, :] > (node_positions[:, None] - sliding_window)
    scores.masked_fill_(~allowed.repeat(g, 1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, values)  # [KVH, G*n, D]
    return out.view(kvh, g, n, d).permute(2, 0, 1, 3).reshape(n, h, d).to(q.dtype)
