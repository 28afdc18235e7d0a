"""Attention split into parts that are merged by log-sum-exp (pure torch, any device).

A tree node attends to the committed prefix and to its ancestors in the tree. The CUDA backend
computes the prefix part with a fast paged kernel that also returns each row's log-sum-exp
(FlashAttention's ``return_softmax_lse``) and the small in-tree part here in float32; the two
normalised parts are then combined exactly:

    o = (exp(lse1) * o1 + exp(lse2) * o2) / (exp(lse1) + exp(lse2))

Conventions (FlashAttention's and vLLM's ``merge_attn_states``): LSE is the natural log of the
softmax denominator of the scaled (and soft-capped) scores; a row with no visible key has
output 0 and LSE -inf. Some kernels report such rows as +inf, which :func:`merge_by_lse` reads
as -inf, as vLLM's merge does.
"""
from __future__ import annotations

import torch


def masked_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              allowed: torch.Tensor | None, scale: float, softcap: float = 0.0
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of n queries over S keys in float32, with the rows' log-sum-exp.

    Args:
        q: [n, H, D] queries.
        k, v: [S, KVH, D] keys and values (H is a multiple of KVH: grouped-query attention).
        allowed: [n, S] bool, True where query i may see key j; None = all.
        scale: softmax scale.
        softcap: if > 0, scores become softcap * tanh(scores / softcap).

    Returns:
        (out [n, H, D] float32, lse [n, H] float32); rows with no visible key are 0 / -inf.
    """
    n, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qf = q.float().reshape(n, kvh, g, d).permute(1, 2, 0, 3)  # [KVH, G, n, D]
    kf = k.float().permute(1, 0, 2).unsqueeze(1)  # [KVH, 1, S, D]
    vf = v.float().permute(1, 0, 2).unsqueeze(1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [KVH, G, n, S]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [KVH, G, n]; -inf for empty rows
    # exp(scores - lse) would be exp(-inf + inf) = NaN on empty rows; shift those by 0 instead.
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.matmul(probs, vf)  # [KVH, G, n, D]
    return out.permute(2, 0, 1, 3).reshape(n, h, d), lse.permute(2, 0, 1).reshape(n, h)


def merge_by_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over the union of two disjoint key sets, from each part's result.

    Args:
        o1, o2: [n, H, D] attention outputs, each normalised over its own keys.
        lse1, lse2: [n, H] their log-sum-exps (+inf is read as -inf: an empty part).

    Returns:
        (out [n, H, D] float32, lse [n, H] float32); rows empty in both parts are 0 / -inf.
    """
    l1 = _empty_as_neg_inf(lse1.float())
    l2 = _empty_as_neg_inf(lse2.float())
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isinf(m), 0.0, m)  # both parts empty: keep exp() finite (weights 0)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    total = w1 + w2
    denom = torch.where(total > 0, total, 1.0).unsqueeze(-1)
    out = (o1.float() * w1.unsqueeze(-1) + o2.float() * w2.unsqueeze(-1)) / denom
    return out, m + torch.log(total)


def prefix_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                              *, query_positions: torch.Tensor | None = None,
                              key_positions: torch.Tensor | None = None,
                              sliding_window: int = -1, softcap: float = 0.0
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch fallback for the prefix part: every query sees every prefix key (within a window).

    Args:
        q: [n, H, D] tree-node queries.
        k, v: [P, KVH, D] prefix keys/values (possibly only the tail of the prefix).
        scale: softmax scale.
        query_positions: [n] positions of the queries; needed with a sliding window.
        key_positions: [P] positions of the keys (default 0..P-1); needed with a window.
        sliding_window: keys with position <= query position - window are masked (-1: none).
        softcap: logit soft cap (0: none).

    Returns:
        (out [n, H, D] float32, lse [n, H] float32).
    """
    allowed = None
    if sliding_window > 0:
        assert query_positions is not None, "a sliding window needs the query positions"
        if key_positions is None:
            key_positions = torch.arange(k.shape[0], device=q.device)
        allowed = key_positions[None, :] > (query_positions[:, None] - sliding_window)
    return masked_attention_with_lse(q, k, v, allowed, scale, softcap)


def tree_part_with_lse(q: torch.Tensor, k_tree: torch.Tensor, v_tree: torch.Tensor,
                       ancestor_mask: torch.Tensor, scale: float, *,
                       positions: torch.Tensor | None = None, sliding_window: int = -1,
                       softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-tree part: each node sees itself and its ancestors (within a window).

    Several trees can go in one call with a block-diagonal ``ancestor_mask``.

    Args:
        q: [n, H, D] node queries.
        k_tree, v_tree: [n, KVH, D] the nodes' keys/values.
        ancestor_mask: [n, n] bool, [i, j] = j is i or an ancestor of i.
        scale: softmax scale.
        positions: [n] node positions; needed with a sliding window.
        sliding_window: as in :func:`prefix_attention_with_lse`.
        softcap: logit soft cap (0: none).

    Returns:
        (out [n, H, D] float32, lse [n, H] float32).
    """
    allowed = ancestor_mask
    if sliding_window > 0:
        assert positions is not None, "a sliding window needs the node positions"
        allowed = allowed & (positions[None, :] > (positions[:, None] - sliding_window))
    return masked_attention_with_lse(q, k_tree, v_tree, allowed, scale, softcap)


def split_tree_attention(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
                         k_tree: torch.Tensor, v_tree: torch.Tensor, ancestor_mask: torch.Tensor,
                         scale: float, *, node_positions: torch.Tensor | None = None,
                         sliding_window: int = -1, softcap: float = 0.0) -> torch.Tensor:
    """Tree attention as prefix part + tree part merged by LSE, all in torch.

    Same contract as :func:`vllm_recap.vllm.tree_attention.tree_attention` (the dense
    reference), computed the way the CUDA backend composes it.

    Returns:
        [n, H, D] float32.
    """
    o1, l1 = prefix_attention_with_lse(q, k_prefix, v_prefix, scale,
                                       query_positions=node_positions,
                                       sliding_window=sliding_window, softcap=softcap)
    o2, l2 = tree_part_with_lse(q, k_tree, v_tree, ancestor_mask, scale,
                                positions=node_positions, sliding_window=sliding_window,
                                softcap=softcap)
    return merge_by_lse(o1, l1, o2, l2)[0]


def _empty_as_neg_inf(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isposinf(lse), float("-inf"), lse)
