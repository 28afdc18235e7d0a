"""The compiled orderings of sampled candidate rows equal numpy's (the walk's memory rows and
draws are checked bit for bit against whole rows in tests/unit/test_candidate_walk.py)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_recap.core.candidates import descending, memory_rows

pytestmark = pytest.mark.unit


def _rows(seed: int, rows: int, width: int, levels: int, masked: float):
    """Values from few levels (ties), some -inf (masked), distinct ids per row."""
    rng = np.random.default_rng(seed)
    vals = (rng.integers(-levels, levels, (rows, width)) / 3).astype(np.float32)
    vals[rng.random((rows, width)) < masked] = -np.inf
    ids = np.stack([rng.permutation(4 * width)[:width] for _ in range(rows)]).astype(np.int64)
    return vals, ids


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), width=st.integers(1, 70),
       levels=st.sampled_from([1, 3, 1000]), masked=st.sampled_from([0.0, 0.3, 0.9, 1.0]))
def test_descending_is_numpys_stable_argsort(seed, rows, width, levels, masked):
    vals, ids = _rows(seed, rows, width, levels, masked)
    order = np.argsort(-vals, axis=1, kind="stable")
    got_vals, got_ids = descending(vals, ids)
    np.testing.assert_array_equal(got_vals, np.take_along_axis(vals, order, 1))
    np.testing.assert_array_equal(got_ids, np.take_along_axis(ids, order, 1))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), width=st.integers(1, 70),
       k=st.integers(1, 12), levels=st.sampled_from([1, 3, 1000]),
       masked=st.sampled_from([0.0, 0.3, 0.9, 1.0]))
def test_memory_rows_rank_by_value_then_id_and_give_masked_entries_the_lowest_free_ids(
        seed, rows, width, k, levels, masked):
    vals, ids = _rows(seed, rows, width, levels, masked)
    k = min(k, width)
    order = np.lexsort((ids, -vals), axis=-1)[:, :k]
    want_vals = np.take_along_axis(vals, order, 1)
    want_ids = np.take_along_axis(ids, order, 1)
    for r in range(rows):  # a whole row's masked entries tie at -inf and rank by id
        live = int(np.isfinite(want_vals[r]).sum())
        free = [t for t in range(k + live) if t not in set(want_ids[r, :live].tolist())]
        want_ids[r, live:] = free[:k - live]
    got_vals, got_ids = memory_rows(vals, ids, k)
    np.testing.assert_array_equal(got_vals, want_vals)
    np.testing.assert_array_equal(got_ids, want_ids)
