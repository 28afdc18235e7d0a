"""verify_greedy: golden outcomes and brute force over all root paths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.core.trees import ancestors, parents_first_trees
from vllm_recap.core import verify_greedy

pytestmark = pytest.mark.unit

#        0:5
#      /     \
#    1:7     2:8
#    /  \      \
#  3:9  4:6    5:9
TOKENS = np.array([5, 7, 8, 9, 6, 9])
PARENTS = np.array([-1, 0, 0, 1, 1, 2])


@pytest.mark.parametrize(
    ("argmax", "accepted", "bonus"),
    [
        ([7, 9, 0, 1, 0, 0], [1, 3], 1),   # 5 -> 7 -> 9, bonus = argmax at node 3
        ([8, 0, 9, 0, 0, 4], [2, 5], 4),   # the other branch, to its leaf
        ([7, 6, 0, 0, 3, 0], [1, 4], 3),   # second child of node 1
        ([3, 9, 9, 9, 9, 9], [], 3),       # nothing accepted: bonus = root's argmax
        ([7, 5, 0, 0, 0, 0], [1], 5),      # accepted one, then no matching child
    ],
)
def test_golden(argmax: list[int], accepted: list[int], bonus: int) -> None:
    acc, b = verify_greedy(TOKENS, PARENTS, np.array(argmax))
    assert acc.tolist() == accepted and b == bonus
    assert acc.dtype == np.int64


def test_duplicate_sibling_tokens_take_lower_index() -> None:
    acc, bonus = verify_greedy(np.array([1, 2, 2]), np.array([-1, 0, 0]), np.array([2, 3, 4]))
    assert acc.tolist() == [1] and bonus == 3


def test_root_only() -> None:
    acc, bonus = verify_greedy(np.array([4]), np.array([-1]), np.array([9]))
    assert acc.size == 0 and bonus == 9


def test_shape_mismatch() -> None:
    with pytest.raises(ValueError, match=r"must all be \[n\]"):
        verify_greedy(np.array([1, 2]), np.array([-1]), np.array([1, 2]))


@st.composite
def verified_trees(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    parents = draw(parents_first_trees(max_nodes=20))
    n = len(parents)
    tokens = np.array([draw(st.integers(0, 5)) for _ in range(n)])
    # Distinct sibling tokens (as every builder produces) make the accepted path unique.
    for i in range(1, n):
        siblings = {int(tokens[j]) for j in range(1, i) if parents[j] == parents[i]}
        free = [t for t in range(24) if t not in siblings]
        tokens[i] = free[draw(st.integers(0, len(free) - 1))]
    # Mostly follow some child, so deep acceptances get explored too.
    argmax = np.zeros(n, np.int64)
    for i in range(n):
        children = [int(tokens[j]) for j in range(1, n) if parents[j] == i]
        if children and draw(st.integers(0, 3)) > 0:
            argmax[i] = draw(st.sampled_from(children))
        else:
            argmax[i] = draw(st.integers(0, 23))
    return tokens, parents, argmax


@settings(max_examples=80, deadline=None)
@given(verified_trees())
def test_matches_brute_force_over_all_paths(case: tuple[np.ndarray, ...]) -> None:
    tokens, parents, argmax = case
    # A node is on the accepted path iff every edge on its root path matches the target.
    valid = [i for i in range(1, len(tokens))
             if all(tokens[a] == argmax[parents[a]] for a in ancestors(parents, i)[:-1])]
    deepest = max(valid, key=lambda i: len(ancestors(parents, i)), default=0)
    expected = ancestors(parents, deepest)[:-1][::-1]
    acc, bonus = verify_greedy(tokens, parents, argmax)
    assert acc.tolist() == expected
    assert len(valid) == len(expected)  # the valid nodes form exactly one chain
    assert bonus == argmax[deepest]
