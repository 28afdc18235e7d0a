"""The one draft-tree type, and the one pure function that derives its structure.

A tree is flat: node 0 is the root (the last committed token, not a draft), node i > 0 has
``parents[i] < i``. Every prefix of the node list is therefore a tree too, so an engine may
truncate the draft list freely. Builders lay the *best chain* (from the root, repeatedly the
highest-scoring child) at indices 1..L: when that chain is accepted -- the usual case -- the
accepted node at depth d sits at index d and the KV cache needs no compaction.
"""

from __future__ import annotations

import numpy as np


class DraftTree:
    """A proposed draft tree (treat as immutable).

    Attributes:
        tokens: [n] int64 token ids; tokens[0] is the root (history[-1]).
        parents: [n] int64; parents[0] == -1, parents[i] < i.
        scores: [n] float64 builder scores; root 1.0. Higher = more likely accepted.
        chain_len: L, the length of the best chain laid out at 1..L (derived if -1).
    """

    # A plain slotted class, not a frozen dataclass: construction is on the per-step hot path
    # and frozen dataclasses pay object.__setattr__ per field.
    __slots__ = ("tokens", "parents", "scores", "chain_len")

    def __init__(self, tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray,
                 chain_len: int = -1) -> None:
        self.tokens = tokens
        self.parents = parents
        self.scores = scores
        self.chain_len = best_chain_length(parents, scores) if chain_len < 0 else int(chain_len)

    def __repr__(self) -> str:
        return (f"DraftTree(tokens={self.tokens.tolist()}, parents={self.parents.tolist()}, "
                f"chain_len={self.chain_len})")

    @classmethod
    def root_only(cls, root: int) -> DraftTree:
        """A tree with no drafts."""
        return cls(np.array([root], np.int64), np.array([-1], np.int64), np.array([1.0]), 0)

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return int(self.tokens.shape[0])

    @property
    def num_drafts(self) -> int:
        """Draft nodes (root excluded)."""
        return int(self.tokens.shape[0]) - 1

    @property
    def draft_tokens(self) -> np.ndarray:
        """[n - 1] int64: tokens[1:], the draft list in layout order."""
        return self.tokens[1:]

    def best_path(self, max_len: int | None = None) -> np.ndarray:
        """Token ids of the best chain, root excluded, at most `max_len` of them.

        Returns:
            [<= min(L, max_len)] int64.
        """
        length = self.chain_len if max_len is None else min(self.chain_len, max(0, max_len))
        return self.tokens[1 : 1 + length]

    def truncate(self, n_nodes: int) -> DraftTree:
        """The first `n_nodes` nodes, root included (a valid tree since parents come first)."""
        n = max(1, min(int(n_nodes), self.num_nodes))
        return DraftTree(self.tokens[:n], self.parents[:n], self.scores[:n],
                         min(self.chain_len, n - 1))

    def is_chain(self) -> bool:
        """True if every node's parent is the node before it (a single path)."""
        return bool(np.all(self.parents[1:] == np.arange(self.num_nodes - 1)))

    def validate(self) -> None:
        """Raises ValueError unless the arrays form a parents-first tree (for tests/debug)."""
        if not (self.tokens.shape == self.parents.shape == self.scores.shape):
            raise ValueError(
                f"tokens/parents/scores shapes differ: {self.tokens.shape}, "
                f"{self.parents.shape}, {self.scores.shape}"
            )
        tree_structure(self.parents)


def tree_structure(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Depths, position offsets and the ancestor mask of a parents-first tree.

    The mask rule is SGLang's: a node's row is its parent's row plus its own diagonal.

    Args:
        parents: [n] int; parents[0] == -1 and 0 <= parents[i] < i for i > 0.

    Returns:
        depths: [n] int64, root 0.
        positions: [n] int64 position offsets from the root (= depths; a node's position is
            prefix length + depth).
        mask: [n, n] bool, mask[i, j] = j is i or an ancestor of i.

    Raises:
        ValueError: if `parents` is not a parents-first tree.
    """
    parents = np.asarray(parents)
    n = parents.shape[0]
    if parents.ndim != 1 or n == 0 or parents[0] != -1:
        raise ValueError(f"parents must be 1-D with parents[0] == -1, got {parents!r}")
    idx = np.arange(1, n)
    bad = (parents[1:] < 0) | (parents[1:] >= idx)
    if bad.any():
        i = int(idx[bad][0])
        raise ValueError(f"parents[{i}] = {int(parents[i])} must be in [0, {i})")
    depths = np.zeros(n, np.int64)
    mask = np.zeros((n, n), np.bool_)
    mask[0, 0] = True
    for i in range(1, n):
        p = parents[i]
        depths[i] = depths[p] + 1
        mask[i, :i] = mask[p, :i]
        mask[i, i] = True
    return depths, depths.copy(), mask


def best_chain_length(parents: np.ndarray, scores: np.ndarray) -> int:
    """Length L of the best chain if it is laid out at 1..L (else the laid-out part of it).

    The best chain follows, from the root, the highest-scoring child (ties: lower index).
    """
    n = len(parents)
    best = np.full(n, -1, np.int64)
    for u in range(1, n):
        p = parents[u]
        if best[p] < 0 or scores[u] > scores[best[p]]:
            best[p] = u
    length = 0
    while best[length] == length + 1:
        length += 1
    return length
