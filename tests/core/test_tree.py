"""DraftTree, tree_depths and ancestor_mask: golden layout, helpers, invariants on random trees."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings

from tests.core.trees import ancestors, parents_first_trees
from vllm_recap.core import DraftTree, ancestor_mask, tree_depths

pytestmark = pytest.mark.unit


def test_golden_structure() -> None:
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    parents = np.array([-1, 0, 0, 1, 1, 2])
    depths = tree_depths(parents)
    mask = ancestor_mask(parents)
    assert depths.tolist() == [0, 1, 1, 2, 2, 2] and depths.dtype == np.int64
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
@pytest.mark.parametrize("derive", [tree_depths, ancestor_mask, lambda p: DraftTree(p, p, p)])
def test_structure_rejects_non_parents_first(parents: list[int], message: str,
                                             derive: Callable[[np.ndarray], object]) -> None:
    with pytest.raises(ValueError, match=message):
        derive(np.array(parents, np.int64))


@settings(max_examples=60, deadline=None)
@given(parents_first_trees())
def test_structure_matches_brute_force(parents: np.ndarray) -> None:
    depths, mask = tree_depths(parents), ancestor_mask(parents)
    n = len(parents)
    for i in range(n):
        anc = ancestors(parents, i)
        assert depths[i] == len(anc) - 1
        assert sorted(np.flatnonzero(mask[i]).tolist()) == sorted(anc)
    # Every prefix of a parents-first list is a tree with the same structure.
    for m in range(1, n + 1):
        np.testing.assert_array_equal(tree_depths(parents[:m]), depths[:m])
        np.testing.assert_array_equal(ancestor_mask(parents[:m]), mask[:m, :m])


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
    assert t.depths.tolist() == [0, 1, 2, 3, 1, 2]  # derived: none given
    assert t.num_nodes == 6 and t.num_drafts == 5
    assert t.draft_tokens.tolist() == [11, 12, 13, 14, 15]
    assert t.best_path().tolist() == [11, 12, 13]
    assert t.best_path(2).tolist() == [11, 12]
    assert t.best_path(0).tolist() == []
    assert not t.is_chain()
    short = t.truncate(3)
    assert short.tokens.tolist() == [10, 11, 12] and short.chain_len == 2 and short.is_chain()
    assert short.depths.tolist() == [0, 1, 2]
    short.validate()
    assert t.truncate(0).num_nodes == 1  # the root always stays
    assert t.truncate(99).num_nodes == 6
    t.validate()


def test_root_only() -> None:
    t = DraftTree.root_only(7)
    assert t.tokens.tolist() == [7] and t.parents.tolist() == [-1] and t.depths.tolist() == [0]
    assert t.num_drafts == 0 and t.chain_len == 0 and t.best_path(4).size == 0 and t.is_chain()


def test_chain_len_derivation_stops_where_layout_breaks() -> None:
    # Best child of the root is node 2 (score 0.5 > 0.4), not node 1: nothing laid out first.
    parents = np.array([-1, 0, 0])
    assert DraftTree(parents, parents, np.array([1.0, 0.4, 0.5])).chain_len == 0
    # Ties go to the lower index; any int/float dtypes are accepted.
    scores = np.array([1, 0.5, 0.5], np.float32)
    assert DraftTree(parents, parents.astype(np.int32), scores).chain_len == 1


def test_chain_len_derivation_rejects_mismatched_scores() -> None:
    with pytest.raises(ValueError, match=r"scores must be \[3\], got \(2,\)"):
        DraftTree(np.zeros(3), np.array([-1, 0, 0]), np.array([1.0, 0.5]))


def test_validate_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        DraftTree(np.array([1, 2]), np.array([-1, 0]), np.array([1.0]), 1).validate()


def test_validate_rejects_wrong_depths() -> None:
    with pytest.raises(ValueError, match=r"depths \[0, 2\] do not match the parents"):
        DraftTree(np.array([1, 2]), np.array([-1, 0]), np.array([1.0, 0.5]), 1,
                  np.array([0, 2])).validate()


def test_best_first_prefix_is_the_best_subtree_not_the_best_chain() -> None:
    #        0
    #      /   \
    #     1(.9)  4(.5)        builders' layout: the best chain 0-1-2-3 first
    #     |
    #     2(.4)
    #     |
    #     3(.3)
    tree = DraftTree(np.arange(5), np.array([-1, 0, 1, 2, 0]), np.array([1.0, .9, .4, .3, .5]))
    assert tree.chain_len == 3
    best = tree.best_first()
    best.validate()
    assert best.tokens.tolist() == [0, 1, 4, 2, 3]  # a 2-draft prefix: both depth-1 nodes
    assert best.parents.tolist() == [-1, 0, 0, 1, 3]
    assert best.truncate(3).draft_tokens.tolist() == [1, 4]


@settings(max_examples=60, deadline=None)
@given(parents_first_trees())
def test_best_first_is_a_parents_first_layout_by_capped_score(parents: np.ndarray) -> None:
    n = parents.shape[0]
    rng = np.random.default_rng(n)
    scores = np.r_[1.0, rng.random(n - 1)]
    tree = DraftTree(np.arange(n) + 100, parents, scores,
                     sources=np.arange(n))
    best = tree.best_first()
    best.validate()  # parents first, depths consistent
    order = best.sources  # original index of each laid-out node
    assert order[0] == 0 and sorted(order.tolist()) == list(range(n))
    np.testing.assert_array_equal(best.tokens, tree.tokens[order])
    # each node keeps its parent (through the permutation)
    for i in range(1, n):
        assert order[best.parents[i]] == parents[order[i]]
    # capped scores never increase along the layout: every prefix is a best subtree
    capped = scores.copy()
    for i in range(1, n):
        capped[i] = min(capped[i], capped[parents[i]])
    assert np.all(np.diff(capped[order]) <= 1e-12)


@settings(max_examples=60, deadline=None)
@given(parents_first_trees(max_nodes=40))
def test_best_first_orders_ties_shallower_then_earlier(parents: np.ndarray) -> None:
    # Few distinct scores: capped ties are the rule, and their order is the layout's contract
    # (every tensor-parallel rank must lay out the same tree). Reference: numpy's lexsort.
    n = parents.shape[0]
    rng = np.random.default_rng(n)
    scores = np.r_[1.0, rng.choice([0.9, 0.5, 0.25], n - 1)].astype(np.float32)
    tree = DraftTree(np.arange(n) + 7, parents.astype(np.int32), scores)
    capped = scores.astype(np.float64)
    for i in range(1, n):
        capped[i] = min(capped[i], capped[parents[i]])
    order = np.lexsort((np.arange(n), tree_depths(parents), -capped))
    best = tree.best_first()
    best.validate()
    assert best.sources is None
    np.testing.assert_array_equal(best.tokens, np.arange(n)[order] + 7)
    np.testing.assert_array_equal(best.scores, scores[order])
    assert best.chain_len == DraftTree(best.tokens, best.parents, best.scores).chain_len


def test_depth_first_puts_the_best_chain_first_and_each_path_in_one_run() -> None:
    # best-first layout of the tree above: [0, 1, 4, 2, 3] -> depth first [0, 1, 2, 3, 4]
    tree = DraftTree(np.arange(5), np.array([-1, 0, 1, 2, 0]), np.array([1.0, .9, .4, .3, .5]))
    best = tree.best_first()
    laid = best.depth_first()
    laid.validate()
    assert laid.tokens.tolist() == [0, 1, 2, 3, 4] and laid.parents.tolist() == [-1, 0, 1, 2, 0]
    assert laid.chain_len == 3
    assert best.truncate(3).depth_first().tokens.tolist() == [0, 1, 4]  # already in order
    chain = DraftTree(np.arange(4), np.array([-1, 0, 1, 2]), np.ones(4))
    assert chain.depth_first() is chain


@settings(max_examples=60, deadline=None)
@given(parents_first_trees())
def test_depth_first_is_a_preorder_keeping_sibling_order(parents: np.ndarray) -> None:
    n = parents.shape[0]
    tree = DraftTree(np.arange(n) + 100, parents, np.r_[1.0, np.full(n - 1, 0.5)],
                     sources=np.arange(n))
    laid = tree.depth_first()
    laid.validate()
    order = laid.sources
    assert order[0] == 0 and sorted(order.tolist()) == list(range(n))
    np.testing.assert_array_equal(laid.tokens, tree.tokens[order])
    for i in range(1, n):
        assert order[laid.parents[i]] == parents[order[i]]
    # preorder: every node's subtree is the run of indices right after it
    size = np.ones(n, np.int64)
    for i in range(n - 1, 0, -1):
        size[laid.parents[i]] += size[i]
    for v in range(n):
        inside = [u for u in range(n) if v in ancestors(laid.parents, u) or u == v]
        assert inside == list(range(v, v + size[v]))
    # siblings keep their layout order
    for v in range(n):
        kids = [order[u] for u in range(1, n) if laid.parents[u] == v]
        assert kids == sorted(kids)
