"""Suffix automaton: golden continuations and brute-force longest earlier match."""

from __future__ import annotations

import pytest
import numpy as np
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


# ---------------------------------------------------------------- counts, recency, matching


def brute_continuations(tokens: list[int]) -> tuple[int, list[tuple[int, int, int]]]:
    """(matched length, [(token, count, latest end position)]) of the longest repeated
    suffix: every token that followed an earlier occurrence of it, by count then recency."""
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        suffix = tokens[n - length:]
        ends = [e for e in range(length - 1, n - 1) if tokens[e - length + 1: e + 1] == suffix]
        if ends:
            follow: dict[int, tuple[int, int]] = {}
            for e in ends:
                count, last = follow.get(tokens[e + 1], (0, -1))
                follow[tokens[e + 1]] = (count + 1, max(last, e + 1))
            return length, sorted(((t, c, p) for t, (c, p) in follow.items()),
                                  key=lambda x: (-x[1], -x[2]))
    return 0, []


def test_golden_continuations_count_every_occurrence() -> None:
    # "7 1" occurred at 1-2 (then 2), 5-6 (then 2) and 9-10 (then 3): 2 twice, 3 once.
    sam = SuffixAutomaton([5, 7, 1, 2, 6, 7, 1, 2, 8, 7, 1, 3, 9, 7, 1])
    state, length = sam.matched()
    assert length == 2 and sam.continuations(state) == [(2, 2, 7), (3, 1, 11)]
    sam2 = SuffixAutomaton([7, 1, 2, 7, 1, 3, 5, 7, 1])
    state2, length2 = sam2.matched()
    assert length2 == 2 and sam2.continuations(state2) == [(3, 1, 5), (2, 1, 2)]  # recency
    assert SuffixAutomaton([1, 2, 3]).matched() == (0, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=120))
def test_counts_and_recency_match_brute_force(tokens: list[int]) -> None:
    sam = SuffixAutomaton()
    for i, t in enumerate(tokens):
        sam.append(t)
        state, length = sam.matched()
        expected_length, expected = brute_continuations(tokens[: i + 1])
        assert length == expected_length
        got = sam.continuations(state) if state else []
        # The automaton may also know the transition ending at the current position (in a
        # periodic text the matched context continues into the suffix itself): its count
        # and end position agree with the text's.
        assert [c for c in got if c[0] in {e[0] for e in expected}] == expected


def brute_longest_match(text: list[int], pattern: list[int]) -> int:
    for length in range(len(pattern), 0, -1):
        suffix = pattern[len(pattern) - length:]
        if any(text[i: i + length] == suffix for i in range(len(text) - length + 1)):
            return length
    return 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.integers(0, 3), max_size=30))
def test_match_against_finds_the_longest_suffix_in_the_text(text: list[int],
                                                             pattern: list[int]) -> None:
    sam = SuffixAutomaton(text)
    match = np.zeros(2, np.int64)
    for i, t in enumerate(pattern):
        sam.match_against(np.array([t], np.int64), match)
        assert match[1] == brute_longest_match(text, pattern[: i + 1])


def test_separator_stops_matches_and_capacity_stays_within_max_tokens() -> None:
    sep = SuffixAutomaton.SEPARATOR
    sam = SuffixAutomaton([1, 2, 3, sep, 4, 5], max_tokens=100)
    match = np.zeros(2, np.int64)
    sam.match_against(np.array([3, 4], np.int64), match)
    assert match[1] == 1  # "3 4" is not in the text: the separator sits between them
    sam.extend(np.arange(90) % 11)
    assert sam.arrays()[0].shape[1] == 2 * 100 + 2  # capacity capped at max_tokens
    assert sam.nbytes < 250 * 100 + 1000
