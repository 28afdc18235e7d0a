"""Online suffix automaton over a request's prompt + committed tokens (or a shared corpus).

Answers per step in O(1): which is the longest suffix of the history that occurred before,
and what followed its earlier occurrences? The state reached by the whole history is its own
endpos class {n-1}; its suffix link is the longest suffix with another, earlier end position
(the *matched* state). That state's first end position (`firstpos`) is the earliest such
occurrence (the classic continuation, `continuation`); its outgoing transitions are the
distinct tokens that followed the occurrences, and the occurrence count (``|endpos|``) of each
transition's target says how many occurrences continued that way -- the evidence the tree
builder grows continuations from (``_kernels.build_evidence``). Appending is amortised O(1)
(Blumer et al. 1985) plus a walk of at most ``_kernels.SAM_WALK`` states that keeps the counts
and latest end positions.

The automaton lives in flat arrays updated by a compiled kernel (``_kernels.sam_extend``):
about 150 bytes per token instead of ~500 for dicts of Python ints, and a commit of a few
tokens costs a few microseconds instead of ~20 once caches are cold.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from vllm_recap.core import _kernels as kernels


# Rows of SuffixAutomaton._states [6, S] int32 (the kernel unpacks them in this order).
_LEN, _LINK, _FIRST, _HEAD, _CNT, _LAST = range(6)
_ROWS = 6


class SuffixAutomaton:
    """Suffix automaton with end positions and occurrence counts, over ids in [0, 2**21).

    Token id ``SEPARATOR`` (2**21 - 1, above every vocabulary) separates documents in a shared
    corpus: nothing is ever matched across it, and continuations never propose it.
    """

    INITIAL_TOKENS = 64
    SEPARATOR = (1 << 21) - 1

    # _toks [cap] int64 the history; _states [6, S] int32 rows (length of the longest string,
    # suffix link, earliest end position, first outgoing edge or -1, occurrence count, latest
    # end position); _edges [3, E] int32 rows
    # (token, target state, next edge of the same state or -1: a state's edges form a linked
    # list, needed to copy them into a clone); _hkeys [H] int64 / _hvals [H] int32 hash the
    # transitions (state << 21 | token -> edge); _meta [4] int64 (tokens, states, edges,
    # last state). Few arrays, so the kernels take them as plain arguments.
    __slots__ = ("_toks", "_states", "_edges", "_hkeys", "_hvals", "_meta", "_limit")

    def __init__(self, tokens: Iterable[int] = (), max_tokens: int | None = None) -> None:
        """Args: tokens: initial text; max_tokens: capacity never grows past this (the
        caller keeps the text within it), so memory stays bounded by it."""
        self._meta = np.array([0, 1, 0, 0], np.int64)  # tokens, states, edges, last state
        self._limit = max_tokens
        self._allocate(min(self.INITIAL_TOKENS, max_tokens or self.INITIAL_TOKENS))
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
        states = np.zeros((_ROWS, n_states), np.int32)
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
            grown = max(need, 2 * self._toks.shape[0])
            self._allocate(grown if self._limit is None else max(need, min(grown, self._limit)))
        kernels.sam_extend(new, self._toks, self._states, self._edges, self._hkeys, self._hvals,
                           self._meta)

    def append(self, token: int) -> None:
        """Appends one token."""
        self.extend(np.array([token], np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes held by the automaton's arrays (its capacity, not its fill)."""
        return sum(a.nbytes for a in (self._toks, self._states, self._edges, self._hkeys,
                                      self._hvals, self._meta))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(states, edges): what the tree builder reads (replaced when the automaton grows)."""
        return self._states, self._edges

    def matched(self) -> tuple[int, int]:
        """(state, length) of the longest suffix that also ended earlier; (0, 0) if none."""
        last = int(self._meta[3])
        state = int(self._states[_LINK, last]) if last else -1
        if state <= 0:
            return 0, 0
        return state, int(self._states[_LEN, state])

    def match_against(self, tokens: np.ndarray, match: np.ndarray) -> None:
        """Extends `match` [2] int64 = (state, length), the longest suffix of the tokens fed
        so far that occurs in this automaton's text, by `tokens` (int64)."""
        kernels.sam_match(tokens, self._states, self._edges, self._hkeys, self._hvals, match)

    def continuations(self, state: int) -> list[tuple[int, int, int]]:
        """(token, occurrence count, latest end position) of each transition out of `state`,
        by count then recency: what followed that context, and how often (tests, metrics)."""
        out = []
        e = int(self._states[_HEAD, state])
        while e >= 0:
            to = int(self._edges[1, e])
            out.append((int(self._edges[0, e]), int(self._states[_CNT, to]),
                        int(self._states[_LAST, to])))
            e = int(self._edges[2, e])
        return sorted(out, key=lambda c: (-c[1], -c[2]))

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
