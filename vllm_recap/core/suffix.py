"""Online suffix automaton over a request's prompt + committed tokens.

Answers one question per step in O(1): what followed an *earlier* occurrence of the longest
suffix of the history that occurred before? The state reached by the whole history is its own
endpos class {n-1}; its suffix link is the longest suffix with another, earlier end position,
and that state's first end position (`firstpos`) is the earliest such occurrence. Appending is
amortised O(1) (Blumer et al. 1985).

The automaton lives in flat arrays updated by a compiled kernel (``_kernels.sam_extend``):
about 150 bytes per token instead of ~500 for dicts of Python ints, and a commit of a few
tokens costs a few microseconds instead of ~20 once caches are cold.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from vllm_recap.core import _kernels as kernels


# Rows of SuffixAutomaton._states [4, S] int32 (the kernel unpacks them in this order).
_LEN, _LINK, _FIRST, _HEAD = range(4)


class SuffixAutomaton:
    """Suffix automaton with first end positions, over int token ids in [0, 2**21)."""

    INITIAL_TOKENS = 64

    # _toks [cap] int64 the history; _states [4, S] int32 rows (length of the longest string,
    # suffix link, earliest end position, first outgoing edge or -1); _edges [3, E] int32 rows
    # (token, target state, next edge of the same state or -1: a state's edges form a linked
    # list, needed to copy them into a clone); _hkeys [H] int64 / _hvals [H] int32 hash the
    # transitions (state << 21 | token -> edge); _meta [4] int64 (tokens, states, edges,
    # last state). Few arrays, so the kernels take them as plain arguments.
    __slots__ = ("_toks", "_states", "_edges", "_hkeys", "_hvals", "_meta")

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self._meta = np.array([0, 1, 0, 0], np.int64)  # tokens, states, edges, last state
        self._allocate(self.INITIAL_TOKENS)
        self._states[_LINK, 0] = -1
        self._states[_FIRST, 0] = -1
        self.extend(tokens)

    def _allocate(self, n_tokens: int) -> None:
        """(Re)allocates for up to n_tokens tokens, keeping the current contents."""
        n_states, n_edges = 2 * n_tokens + 2, 3 * n_tokens + 3
        size = 1
        while size < 2 * n_edges:
            size *= 2
        toks = np.zeros(n_tokens, np.int64)
        states = np.zeros((4, n_states), np.int32)
        edges = np.zeros((3, n_edges), np.int32)
        hkeys, hvals = np.full(size, kernels.EMPTY, np.int64), np.zeros(size, np.int32)
        if getattr(self, "_toks", None) is not None:
            n, ns, ne = (int(x) for x in self._meta[:3])
            toks[:n] = self._toks[:n]
            states[:, :ns] = self._states[:, :ns]
            edges[:, :ne] = self._edges[:, :ne]
            kernels.sam_rehash(states, edges, ns, hkeys, hvals)
        else:
            states[_HEAD, 0] = -1  # the root has no edges yet
        self._toks, self._states, self._edges = toks, states, edges
        self._hkeys, self._hvals = hkeys, hvals

    def __len__(self) -> int:
        return int(self._meta[0])

    @property
    def tokens(self) -> np.ndarray:
        """[n] int64 copy of the appended tokens."""
        return self._toks[: self._meta[0]].copy()

    def extend(self, tokens: Iterable[int]) -> None:
        """Appends tokens, each in [0, 2**21) (not checked here: the Drafter validates)."""
        new = np.ascontiguousarray(np.fromiter(tokens, np.int64) if not isinstance(
            tokens, np.ndarray) else tokens, np.int64).reshape(-1)
        if new.size == 0:
            return
        need = int(self._meta[0]) + new.size
        if need > self._toks.shape[0]:
            self._allocate(max(need, 2 * self._toks.shape[0]))
        kernels.sam_extend(new, self._toks, self._states, self._edges, self._hkeys, self._hvals,
                           self._meta)

    def append(self, token: int) -> None:
        """Appends one token."""
        self.extend(np.array([token], np.int64))

    def match(self) -> tuple[int, int]:
        """(length, end) of the longest suffix that also ended at an earlier position `end`
        (the earliest one); (0, -1) if none."""
        last = int(self._meta[3])
        state = int(self._states[_LINK, last]) if last else -1
        if state <= 0:
            return 0, -1
        return int(self._states[_LEN, state]), int(self._states[_FIRST, state])

    def continuation(self, max_len: int, min_match: int = 1) -> np.ndarray:
        """Tokens that followed the earliest earlier occurrence of the longest repeated suffix.

        Args:
            max_len: at most this many tokens.
            min_match: return nothing if the matched suffix is shorter than this.

        Returns:
            [<= max_len] int64 (a copy).
        """
        length, end = self.match()
        if length < min_match or max_len <= 0:
            return self._toks[:0].copy()
        return self._toks[end + 1: min(end + 1 + max_len, int(self._meta[0]))].copy()
