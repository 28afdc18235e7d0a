"""The one draft-tree type, and the pure functions that derive its structure.

A tree is flat: node 0 is the root (the last committed token, not a draft), node i > 0 has
``parents[i] < i``. Every prefix of the node list is therefore a tree too, so an engine may
truncate the draft list freely. Builders lay the *best chain* (from the root, repeatedly the
highest-scoring child) at indices 1..L: when that chain is accepted -- the usual case -- the
accepted node at depth d sits at index d and the KV cache needs no compaction.
"""

from __future__ import annotations

import numpy as np

from vllm_recap.core import _kernels as kernels


# Bits of DraftTree.sources.
SOURCE_MEMORY = 1  # a fused candidate of the memories (G/C/U)
SOURCE_SUFFIX = 2  # a continuation of the request's own prompt + output
SOURCE_SHARED = 4  # a continuation from the shared index (earlier requests' outputs)


class DraftTree:
    """A proposed draft tree (treat as immutable).

    Attributes:
        tokens: [n] int64 token ids; tokens[0] is the root (history[-1]).
        parents: [n] int64; parents[0] == -1, parents[i] < i.
        scores: [n] float64 builder scores; root 1.0. Higher = more likely accepted.
        chain_len: L, the length of the best chain laid out at 1..L (derived if -1).
        depths: [n] int64 node depths, root 0 (the builders write them; derived if None).
        sources: [n] int64 bit mask of the sources that proposed each node (SOURCE_MEMORY,
            SOURCE_SUFFIX, SOURCE_SHARED; 0 for the root), or None where the builder does not
            track them (suffix_mode earliest, Token Recycling, trees built by hand).
    """

    # A plain slotted class, not a frozen dataclass: construction is on the per-step hot path
    # and frozen dataclasses pay object.__setattr__ per field.
    __slots__ = ("tokens", "parents", "scores", "chain_len", "depths", "sources")

    def __init__(self, tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray,
                 chain_len: int = -1, depths: np.ndarray | None = None,
                 sources: np.ndarray | None = None) -> None:
        self.tokens = tokens
        self.parents = parents
        self.scores = scores
        self.chain_len = _chain_length(parents, scores) if chain_len < 0 else int(chain_len)
        self.depths = tree_depths(parents) if depths is None else depths
        self.sources = sources

    def __repr__(self) -> str:
        return (f"DraftTree(tokens={self.tokens.tolist()}, parents={self.parents.tolist()}, "
                f"chain_len={self.chain_len})")

    @classmethod
    def root_only(cls, root: int) -> DraftTree:
        """A tree with no drafts."""
        return cls(np.array([root], np.int64), np.array([-1], np.int64), np.array([1.0]), 0,
                   np.zeros(1, np.int64))

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
        if n == self.num_nodes:
            return self  # trees are not modified after they are built (as best_first)
        return DraftTree(self.tokens[:n], self.parents[:n], self.scores[:n],
                         min(self.chain_len, n - 1), self.depths[:n],
                         None if self.sources is None else self.sources[:n])

    def best_first(self) -> DraftTree:
        """The same tree laid out best node first: by score, each score capped by its
        ancestors' (so parents come first), ties to the shallower then the earlier node.

        Every prefix of this layout is the best subtree of its size by score, which is what
        an engine that verifies a prefix (the adaptive node budget) should get; the builders'
        layout puts the whole best chain first, so a prefix of b nodes was mostly a chain.
        Deterministic (every tensor-parallel rank lays out the same tree).
        """
        n = self.num_nodes
        if n <= 2:
            return self
        ints, scores = np.empty((4, n), np.int64), np.empty(n)
        sources = self.sources
        chain = kernels.relay_best_first(
            _int64(self.tokens), _int64(self.parents), _float64(self.scores),
            _int64(self.depths), self.parents if sources is None else _int64(sources),
            sources is not None, ints, scores)
        return DraftTree(ints[0], ints[1], scores, chain, ints[2],
                         None if sources is None else ints[3])

    def depth_first(self) -> DraftTree:
        """The same tree in depth-first preorder, children in layout order.

        Each root-to-leaf path's own nodes (those no earlier path holds) are then one run of
        indices and the first path is nodes 0..L, the best chain when every node's first
        child is its best (builders' and best-first layouts alike). CPU tree attention
        verifies a path as one request whose queries are such a run: in this layout it
        reads the rows in place, with no permutation of queries and outputs in every layer,
        and an accepted best chain already sits at its KV slots (no compaction).
        """
        n = self.num_nodes
        if n <= 2:
            return self
        parents = self.parents.tolist()
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            children[parents[i]].append(i)
        order, stack = [], [0]
        while stack:
            v = stack.pop()
            order.append(v)
            stack.extend(reversed(children[v]))
        if order == list(range(n)):
            return self
        chain = 0
        while chain + 1 < n and parents[order[chain + 1]] == order[chain]:
            chain += 1
        return self._relaid(np.array(order, np.int64), chain)

    def _relaid(self, order: np.ndarray, chain_len: int = -1) -> DraftTree:
        """The same nodes in ``order`` (a parents-first permutation with the root first)."""
        n = self.num_nodes
        new_index = np.empty(n, np.int64)
        new_index[order] = np.arange(n)
        old_parents = self.parents[order]
        parents = np.where(old_parents >= 0, new_index[np.maximum(old_parents, 0)], -1)
        return DraftTree(self.tokens[order], parents, self.scores[order], chain_len,
                         self.depths[order], None if self.sources is None else self.sources[order])

    def leading_chain(self) -> int:
        """How many draft nodes a prefix of this layout may keep and still be one path."""
        parents = self.parents.tolist()
        k = 1
        while k < len(parents) and parents[k] == k - 1:
            k += 1
        return k - 1

    def first_path(self) -> DraftTree:
        """The path from the root through each node's first child in layout order (of a
        best-first layout: its best chain), as the first path of `depth_first` lays it out.

        Deterministic: every tensor-parallel rank derives the same path from the same tree.
        """
        nodes = np.array([0, *first_path_nodes(self.parents.tolist())], np.int64)
        n = nodes.shape[0]
        return DraftTree(self.tokens[nodes], np.arange(-1, n - 1, dtype=np.int64),
                         self.scores[nodes], n - 1, np.arange(n, dtype=np.int64),
                         None if self.sources is None else self.sources[nodes])

    def is_chain(self) -> bool:
        """True if every node's parent is the node before it (a single path)."""
        return bool(np.all(self.parents[1:] == np.arange(self.num_nodes - 1)))

    def validate(self) -> None:
        """Raises ValueError unless the arrays form a parents-first tree with matching depths
        (for tests/debug)."""
        shapes = (self.tokens.shape, self.parents.shape, self.scores.shape, self.depths.shape)
        if len(set(shapes)) != 1:
            raise ValueError(f"tokens/parents/scores/depths shapes differ: {shapes}")
        if not np.array_equal(tree_depths(self.parents), self.depths):
            raise ValueError(f"depths {self.depths.tolist()} do not match the parents")


def _int64(a: np.ndarray) -> np.ndarray:
    """A contiguous int64 array (a no-op for the builders' arrays: the kernels compile for
    one specialisation)."""
    if a.dtype == np.int64 and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, np.int64)


def _float64(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.float64 and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, np.float64)


def first_path_nodes(parents: list[int]) -> list[int]:
    """Node indices of the path through each node's first child (lowest index), root
    excluded: the nodes of `DraftTree.first_path`, from a parents-first ``parents`` list."""
    first = [-1] * len(parents)
    for i in range(len(parents) - 1, 0, -1):
        first[parents[i]] = i
    path, v = [], first[0] if parents else -1
    while v > 0:
        path.append(v)
        v = first[v]
    return path


def _checked_parents(parents: np.ndarray) -> np.ndarray:
    """`parents` as an array, or ValueError naming the first entry that breaks parents-first."""
    parents = np.asarray(parents)
    n = parents.shape[0] if parents.ndim == 1 else 0
    if n == 0 or parents[0] != -1:
        raise ValueError(f"parents must be 1-D with parents[0] == -1, got {parents!r}")
    idx = np.arange(1, n)
    bad = (parents[1:] < 0) | (parents[1:] >= idx)
    if bad.any():
        i = int(idx[bad][0])
        raise ValueError(f"parents[{i}] = {int(parents[i])} must be in [0, {i})")
    return parents


def _chain_length(parents: np.ndarray, scores: np.ndarray) -> int:
    """The builders' best-chain rule (one implementation, in the kernels) for a tree built by
    hand; validated first, since the compiled code does not bounds-check."""
    parents = _checked_parents(parents)
    if np.shape(scores) != parents.shape:
        raise ValueError(f"scores must be [{parents.shape[0]}], got {np.shape(scores)}")
    # Cast: one compiled specialisation whatever the caller passes.
    return int(kernels.best_chain_length(np.ascontiguousarray(parents, np.int64),
                                         np.ascontiguousarray(scores, np.float64)))


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """Node depths of a parents-first tree (a node's position is prefix length + depth).

    Args:
        parents: [n] int; parents[0] == -1 and 0 <= parents[i] < i for i > 0.

    Returns:
        [n] int64, root 0.

    Raises:
        ValueError: if `parents` is not a parents-first tree.
    """
    parents = _checked_parents(parents)
    depths = np.zeros(parents.shape[0], np.int64)
    for i in range(1, parents.shape[0]):
        depths[i] = depths[parents[i]] + 1
    return depths


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """Tree-attention mask of a parents-first tree.

    The rule is SGLang's: a node's row is its parent's row plus its own diagonal.

    Args:
        parents: [n] int; parents[0] == -1 and 0 <= parents[i] < i for i > 0.

    Returns:
        [n, n] bool, mask[i, j] = j is i or an ancestor of i.

    Raises:
        ValueError: if `parents` is not a parents-first tree.
    """
    parents = _checked_parents(parents)
    n = parents.shape[0]
    mask = np.zeros((n, n), np.bool_)
    mask[0, 0] = True
    for i in range(1, n):
        mask[i, :i] = mask[parents[i], :i]
        mask[i, i] = True
    return mask
