"""Fusion (paper eqs. 4-6): hand-computed golden numbers, ablations, invariants."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_recap.core import FusionMode, fuse, row_confidence

pytestmark = pytest.mark.unit

# Three rows, K = 2, most specific first:
#   G: ids (1, 2), P = (0.5, 0.5)  H = ln 2  -> c_G = exp(-ln 2) = 0.5
#   C: ids (2, 3), P = (1.0, 0.0)  H = 0     -> c_C = 1
#   U: ids (3, 1), P = (1.0, 0.0)  H = 0     -> c_U = 1     (id 1 has P = 0: contributes nothing)
IDS = np.array([[1, 2], [2, 3], [3, 1]])
PROBS = np.array([[0.5, 0.5], [1.0, 0.0], [1.0, 0.0]])


def test_golden_priors_entropy() -> None:
    # a*c = 0.7*0.5, 0.2*1, 0.1*1 = 0.35, 0.2, 0.1 (sum 0.65) -> w = 7/13, 4/13, 2/13
    # m(1) = 7/13*0.5 = 3.5/13; m(2) = 7/13*0.5 + 4/13 = 7.5/13; m(3) = 2/13
    # top-2 = {2, 1}: q = 7.5/11, 3.5/11
    f = fuse(IDS, PROBS, FusionMode.PRIORS_ENTROPY, k=2)
    np.testing.assert_allclose(f.weights, [7 / 13, 4 / 13, 2 / 13], rtol=1e-6)
    assert f.ids.tolist() == [2, 1]
    np.testing.assert_allclose(f.q, [7.5 / 11, 3.5 / 11], rtol=1e-6)
    # Keeping all three: q = m / sum(m) = 7.5/13, 3.5/13, 2/13.
    f3 = fuse(IDS, PROBS, FusionMode.PRIORS_ENTROPY, k=3)
    assert f3.ids.tolist() == [2, 1, 3]
    np.testing.assert_allclose(f3.q, [7.5 / 13, 3.5 / 13, 2 / 13], rtol=1e-6)


def test_golden_backoff_uses_most_specific_row_only() -> None:
    f = fuse(IDS, PROBS, FusionMode.BACKOFF, k=2)
    np.testing.assert_allclose(f.weights, [1.0, 0.0, 0.0])
    assert f.ids.tolist() == [1, 2]  # tie 0.5/0.5: the earlier entry first
    np.testing.assert_allclose(f.q, [0.5, 0.5])


def test_golden_uniform() -> None:
    # w = 1/3 each: m(1) = 1/6, m(2) = 1/6 + 1/3 = 1/2, m(3) = 1/3 -> top-2 {2, 3}: q = 0.6, 0.4
    f = fuse(IDS, PROBS, FusionMode.UNIFORM, k=2)
    np.testing.assert_allclose(f.weights, [1 / 3] * 3)
    assert f.ids.tolist() == [2, 3]
    np.testing.assert_allclose(f.q, [0.6, 0.4], rtol=1e-6)


def test_golden_priors_fixed_ignores_entropy() -> None:
    # w = 0.7, 0.2, 0.1: m(1) = 0.35, m(2) = 0.55, m(3) = 0.1 -> q = 0.55/0.9, 0.35/0.9
    f = fuse(IDS, PROBS, FusionMode.PRIORS_FIXED, k=2)
    np.testing.assert_allclose(f.weights, [0.7, 0.2, 0.1], rtol=1e-6)
    assert f.ids.tolist() == [2, 1]
    np.testing.assert_allclose(f.q, [0.55 / 0.9, 0.35 / 0.9], rtol=1e-6)


def test_priors_go_by_rank_among_available_rows() -> None:
    # Only C and U available: they get 0.7 and 0.2 -> w = 7/9, 2/9; m(2) = 7/9, m(3) = 2/9.
    f = fuse(IDS[1:], PROBS[1:], FusionMode.PRIORS_ENTROPY, k=2)
    np.testing.assert_allclose(f.weights, [7 / 9, 2 / 9], rtol=1e-6)
    assert f.ids.tolist() == [2, 3]
    np.testing.assert_allclose(f.q, [7 / 9, 2 / 9], rtol=1e-6)


def test_single_row_is_returned_renormalised() -> None:
    f = fuse(np.array([[4, 9, 2]]), np.array([[1.0, 3.0, 0.0]]))
    assert f.ids.tolist() == [9, 4]
    np.testing.assert_allclose(f.q, [0.75, 0.25])
    np.testing.assert_allclose(f.weights, [1.0])


def test_no_rows() -> None:
    f = fuse(np.zeros((0, 8)), np.zeros((0, 8)))
    assert f.ids.size == 0 and f.q.size == 0 and f.weights.size == 0


def test_row_confidence() -> None:
    np.testing.assert_allclose(row_confidence(np.full(8, 1 / 8)), 1 / 8)
    np.testing.assert_allclose(row_confidence(np.array([1.0, 0.0])), 1.0)
    p = np.array([0.75, 0.25])
    np.testing.assert_allclose(row_confidence(p), math.exp(0.75 * math.log(0.75)
                                                            + 0.25 * math.log(0.25)))


def test_rejects_more_than_three_rows() -> None:
    with pytest.raises(ValueError, match=r"\[r <= 3, K\]"):
        fuse(np.zeros((4, 2)), np.ones((4, 2)))


def _reference(ids: np.ndarray, probs: np.ndarray, mode: FusionMode, k: int) -> dict[int, float]:
    """Straight numpy transcription of eqs. 4-6 (float64), as {id: q}."""
    p = probs / probs.sum(axis=1, keepdims=True)
    r = len(ids)
    a = np.array([0.7, 0.2, 0.1][:r])
    c = np.exp([(np.where(row > 0, row * np.log(np.where(row > 0, row, 1)), 0)).sum() for row in p])
    if mode is FusionMode.BACKOFF:
        w = np.eye(r)[0]
    elif mode is FusionMode.UNIFORM:
        w = np.full(r, 1 / r)
    elif mode is FusionMode.PRIORS_FIXED:
        w = a / a.sum()
    else:
        w = a * c / (a * c).sum()
    m: dict[int, float] = {}
    for j in range(r):
        for z, pz in zip(ids[j], p[j], strict=True):
            if pz > 0 and w[j] > 0:
                m[int(z)] = m.get(int(z), 0.0) + w[j] * pz
    top = sorted(m.items(), key=lambda kv: -kv[1])[:k]
    total = sum(v for _, v in top)
    return {z: v / total for z, v in top}


@st.composite
def row_sets(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    r = draw(st.integers(1, 3))
    width = draw(st.integers(1, 6))
    ids = np.array([draw(st.permutations(range(10)))[:width] for _ in range(r)])
    # Well-separated weights, so float32 storage cannot reorder near-ties.
    probs = np.array([[draw(st.integers(1, 50)) for _ in range(width)] for _ in range(r)],
                     np.float64)
    return ids, probs


@settings(max_examples=120, deadline=None)
@given(row_sets(), st.sampled_from(list(FusionMode)), st.integers(1, 8))
def test_matches_reference_and_sums_to_one(rows: tuple[np.ndarray, np.ndarray],
                                          mode: FusionMode, k: int) -> None:
    ids, probs = rows
    f = fuse(ids, probs, mode, k=k)
    assert math.isclose(f.weights.sum(), 1.0, rel_tol=1e-9)
    assert math.isclose(f.q.sum(), 1.0, rel_tol=1e-9)
    assert len(set(f.ids.tolist())) == len(f.ids) <= k
    assert np.all(np.diff(f.q) <= 1e-12)  # by q descending
    ref = _reference(ids, probs, mode, k)
    got = dict(zip(f.ids.tolist(), f.q.tolist(), strict=True))
    # Same candidate set up to ties at the cut, same q.
    for z in set(got) & set(ref):
        assert math.isclose(got[z], ref[z], rel_tol=1e-5)
    assert len(got) == len(ref)
    cut = min(ref.values())
    for z in set(got) ^ set(ref):
        assert math.isclose(got.get(z, ref.get(z, 0.0)), cut, rel_tol=1e-5)
