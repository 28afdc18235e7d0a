"""The attention math of tree verification (pure torch, any device, no vLLM).

A tree node attends to the committed prefix and to its ancestors and itself. Both backends
compute that with :func:`masked_attention`: the CPU backend densely over prefix + tree
(:func:`tree_attention`), the CUDA backend in two parts -- the prefix by a paged kernel that
returns each row's log-sum-exp, the tree part here -- merged exactly by :func:`merge_by_lse`:

    o = (exp(lse1) * o1 + exp(lse2) * o2) / (exp(lse1) + exp(lse2))

Conventions (FlashAttention's and vLLM's ``merge_attn_states``): LSE is the natural log of the
softmax denominator of the scaled (and soft-capped) scores; a row with no visible key has
output 0 and LSE -inf. Some kernels report such rows as +inf, read here as -inf.
"""
from __future__ import annotations

import torch


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     allowed: torch.Tensor | None, scale: float, softcap: float = 0.0,
                     need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention of n queries over S keys in float32, with the rows' log-sum-exp.

    The G query heads sharing a KV head are folded into rows (row = head-in-group * n + node),
    so one batched matmul per KV head runs and K/V are never expanded per query head.

    Args:
        q: [n, H, D] queries.
        k, v: [S, KVH, D] keys and values (H is a multiple of KVH: grouped-query attention).
        allowed: [n, S] bool, True where query i may see key j; None = all.
        scale: softmax scale.
        softcap: if > 0, scores become softcap * tanh(scores / softcap).
        need_lse: False skips the log-sum-exp (then every row must see at least one key).

    Returns:
        (out [n, H, D] float32, lse [n, H] float32 or None); rows with no visible key are
        0 / -inf.
    """
    n, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    qf = q.float().view(n, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * n, d)
    kf = k.float().transpose(0, 1)  # [KVH, S, D]
    vf = v.float().transpose(0, 1)
    scores = torch.bmm(qf, kf.transpose(1, 2)).mul_(scale)  # [KVH, G*n, S]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if allowed is not None:
        scores.masked_fill_(~allowed.repeat(g, 1), float("-inf"))
    if need_lse:
        lse = torch.logsumexp(scores, dim=-1)  # [KVH, G*n]; -inf for empty rows
        # exp(scores - lse) would be exp(-inf + inf) = NaN on empty rows: shift those by 0.
        probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(probs, vf)  # [KVH, G*n, D]
    out = out.view(kvh, g, n, d).permute(2, 0, 1, 3).reshape(n, h, d)
    if not need_lse:
        return out, None
    return out, lse.view(kvh, g, n).permute(2, 0, 1).reshape(n, h)


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


def window_allowed(query_positions: torch.Tensor, key_positions: torch.Tensor,
                   sliding_window: int) -> torch.Tensor:
    """[n, S] bool: key j is inside query i's sliding window (vLLM: position > q - window)."""
    return key_positions[None, :] > (query_positions[:, None] - sliding_window)


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
    n, p = q.shape[0], k_prefix.shape[0]
    allowed = torch.ones(n, p + n, dtype=torch.bool, device=q.device)
    allowed[:, p:] = ancestor_mask
    if sliding_window > 0:
        assert node_positions is not None, "a sliding window needs the node positions"
        key_pos = torch.cat([torch.arange(p, device=q.device), node_positions])
        allowed &= window_allowed(node_positions, key_pos, sliding_window)
    out, _ = masked_attention(q, torch.cat([k_prefix, k_tree]), torch.cat([v_prefix, v_tree]),
                              allowed, scale, softcap, need_lse=False)
    return out.to(q.dtype)


def _empty_as_neg_inf(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isposinf(lse), float("-inf"), lse)
