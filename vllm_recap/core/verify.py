"""Greedy tree verification: the numpy reference every faster verifier is tested against."""

from __future__ import annotations

import numpy as np


def verify_greedy(
    tokens: np.ndarray, parents: np.ndarray, target_argmax: np.ndarray
) -> tuple[np.ndarray, int]:
    """Walks the tree along the target's greedy choices.

    From the root, repeatedly move to the child whose token equals the target's argmax at the
    current node (if siblings share a token, the lower index). The committed tokens are the
    accepted path's tokens followed by the bonus token, which makes the output identical to
    greedy decoding of the target.

    Args:
        tokens: [n] node token ids, node 0 = root.
        parents: [n] parents-first parent indices, parents[0] == -1.
        target_argmax: [n] the target's argmax after each node's context (row 0 = root).

    Returns:
        accepted: [m] int64 node indices of the accepted path in depth order, root excluded.
        bonus_token: the target's argmax at the last accepted node (the root if m == 0).
    """
    tokens = np.asarray(tokens)
    parents = np.asarray(parents)
    target_argmax = np.asarray(target_argmax)
    n = tokens.shape[0]
    if not (parents.shape == (n,) and target_argmax.shape == (n,)) or n == 0:
        raise ValueError(
            f"tokens, parents and target_argmax must all be [n] with n >= 1, got "
            f"{tokens.shape}, {parents.shape}, {target_argmax.shape}"
        )
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[int(parents[i])].append(i)
    accepted: list[int] = []
    cur = 0
    while True:
        want = target_argmax[cur]
        nxt = next((c for c in children[cur] if tokens[c] == want), -1)
        if nxt < 0:
            break
        accepted.append(nxt)
        cur = nxt
    return np.array(accepted, np.int64), int(target_argmax[cur])
