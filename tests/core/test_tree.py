"""DraftTree and tree_structure: golden layout, helpers, invariants on random trees."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from tests.core.trees import ancestors, parents_first_trees
from vllm_recap.core import DraftTree, tree_structure
from vllm_recap.core.tree import best_chain_length

pytestmark = pytest.mark.unit


def test_golden_structure() -> None:
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    parents = np.array([-1, 0, 0, 1, 1, 2])
    depths, positions, mask = tree_structure(parents)
    assert depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert positions.tolist() == depths.tolist()
    expected = np.array([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1],
    ], bool)
    np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize(
    ("parents", "message"),
    [
        ([], r"parents\[0\] == -1"),
        ([0, 0], r"parents\[0\] == -1"),
        ([-1, 1], r"parents\[1\] = 1 must be in \[0, 1\)"),
        ([-1, 0, -1], r"parents\[2\] = -1 must be in \[0, 2\)"),
        ([-1, 0, 3, 1], r"parents\[2\] = 3 must be in \[0, 2\)"),
    ],
)
def test_structure_rejects_non_parents_first(parents: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tree_structure(np.array(parents, np.int64))


@settings(max_examples=60, deadline=None)
@given(parents_first_trees())
def test_structure_matches_brute_force(parents: np.ndarray) -> None:
    depths, positions, mask = tree_structure(parents)
    n = len(parents)
    for i in range(n):
        anc = ancestors(parents, i)
        assert depths[i] == len(anc) - 1 == positions[i]
        assert sorted(np.flatnonzero(mask[i]).tolist()) == sorted(anc)
    # Every prefix of a parents-first list is a tree with the same structure.
    for m in range(1, n + 1):
        d, _, mk = tree_structure(parents[:m])
        np.testing.assert_array_equal(d, depths[:m])
        np.testing.assert_array_equal(mk, mask[:m, :m])


def _tree() -> DraftTree:
    # Best chain 0 -> 1 -> 2 -> 3 laid out first; 4, 5 are side branches.
    return DraftTree(
        tokens=np.array([10, 11, 12, 13, 14, 15], np.int64),
        parents=np.array([-1, 0, 1, 2, 0, 1], np.int64),
        scores=np.array([1.0, 0.6, 0.3, 0.1, 0.2, 0.05]),
    )


def test_helpers() -> None:
    t = _tree()
    assert t.chain_len == 3
    assert t.num_nodes == 6 and t.num_drafts == 5
    assert t.draft_tokens.tolist() == [11, 12, 13, 14, 15]
    assert t.best_path().tolist() == [11, 12, 13]
    assert t.best_path(2).tolist() == [11, 12]
    assert t.best_path(0).tolist() == []
    assert not t.is_chain()
    short = t.truncate(3)
    assert short.tokens.tolist() == [10, 11, 12] and short.chain_len == 2 and short.is_chain()
    assert t.truncate(0).num_nodes == 1  # the root always stays
    assert t.truncate(99).num_nodes == 6
    t.validate()


def test_root_only() -> None:
    t = DraftTree.root_only(7)
    assert t.tokens.tolist() == [7] and t.parents.tolist() == [-1]
    assert t.num_drafts == 0 and t.chain_len == 0 and t.best_path(4).size == 0 and t.is_chain()


def test_chain_len_derivation_stops_where_layout_breaks() -> None:
    # Best child of the root is node 2 (score 0.5 > 0.4), not node 1: nothing laid out first.
    parents = np.array([-1, 0, 0])
    assert best_chain_length(parents, np.array([1.0, 0.4, 0.5])) == 0
    # Ties go to the lower index.
    assert best_chain_length(parents, np.array([1.0, 0.5, 0.5])) == 1


def test_validate_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        DraftTree(np.array([1, 2]), np.array([-1, 0]), np.array([1.0]), 1).validate()
