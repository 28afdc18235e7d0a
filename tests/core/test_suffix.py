"""Suffix automaton: golden continuations and brute-force longest earlier match."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_recap.core import SuffixAutomaton

pytestmark = pytest.mark.unit


def brute_force(tokens: list[int], max_len: int, min_match: int = 1) -> list[int]:
    """Tokens after the earliest earlier occurrence of the longest suffix seen before."""
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        suffix = tokens[n - length:]
        for end in range(length - 1, n - 1):  # end < n - 1: an *earlier* occurrence
            if tokens[end - length + 1: end + 1] == suffix:
                if length < min_match:
                    return []
                return tokens[end + 1: end + 1 + max_len]
    return []


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        ([1, 2, 3, 1, 2], [3, 1, 2]),        # "1 2" occurred at 0-1, followed by 3 1 2
        ([1, 2, 3, 4], []),                  # nothing repeats
        ([7], []),
        ([], []),
        ([5, 5, 5], [5]),                    # "5 5" ended at 1; what followed: 5
        ([1, 2, 9, 1, 2, 3, 4, 1, 2], [9, 1, 2, 3]),   # earliest occurrence of "1 2"
        ([4, 1, 2, 3, 1, 2, 3, 9, 4], [1, 2, 3, 1]),  # only "4" repeats, from position 0
    ],
)
def test_golden(tokens: list[int], expected: list[int]) -> None:
    sam = SuffixAutomaton(tokens)
    assert sam.continuation(4).tolist() == expected == brute_force(tokens, 4)
    assert len(sam) == len(tokens)


def test_match_and_min_match() -> None:
    sam = SuffixAutomaton([1, 2, 3, 1, 2])
    assert sam.match() == (2, 1)  # length 2, earliest earlier end position 1
    assert sam.continuation(4, min_match=3).tolist() == []
    assert sam.continuation(2).tolist() == [3, 1]
    assert sam.continuation(0).tolist() == []
    assert sam.tokens.tolist() == [1, 2, 3, 1, 2]
    assert SuffixAutomaton().match() == (0, -1)


def test_growth_keeps_the_automaton() -> None:
    # Past the initial allocation the arrays grow and the transition hash is rebuilt.
    tokens = [i % 5 for i in range(3 * SuffixAutomaton.INITIAL_TOKENS)] + [9, 0, 1]
    sam = SuffixAutomaton()
    for start in range(0, len(tokens), 37):
        sam.extend(tokens[start:start + 37])
        assert sam.continuation(5).tolist() == brute_force(tokens[:start + 37], 5)
    assert len(sam) == len(tokens)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=150), st.integers(1, 6), st.integers(1, 3))
def test_matches_brute_force_after_every_append(tokens: list[int], max_len: int,
                                                min_match: int) -> None:
    sam = SuffixAutomaton()
    for i, t in enumerate(tokens):
        sam.append(t)
        assert sam.continuation(max_len, min_match).tolist() == brute_force(
            tokens[: i + 1], max_len, min_match)
