"""Memories: C/G hash table (growth, overwrite, FIFO eviction), U table, U partitions."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_recap.core import _kernels as kernels
from vllm_recap.core.memory import ContextStore, UnigramPartitions, UnigramTable

pytestmark = pytest.mark.unit

KW = 2  # row width used in these tests


class SmallStore(ContextStore):
    INITIAL_ROWS = 4  # exercise growth (rehash) with small inputs


def put(store: ContextStore, u: UnigramTable, contexts: list[tuple[int, int, int]],
        first_ids: list[int]) -> None:
    """Writes one row per context; row i = ids (first_ids[i], first_ids[i] + 1), P = (.75, .25)."""
    ctx3 = np.array(contexts, np.int64).reshape(-1, 3)
    ids = np.array([[f, f + 1] for f in first_ids], np.int64).reshape(-1, KW)
    probs = np.tile(np.array([0.75, 0.25], np.float32), (len(contexts), 1))
    store.reserve(2 * len(contexts))
    assert kernels.observe_contexts(ctx3, ids, probs, (u.rows, True, *store.arrays())) == 0


def test_rows_keyed_by_two_and_three_tokens() -> None:
    store, u = ContextStore(KW, 64), UnigramTable(50, KW)
    put(store, u, [(3, 4, 5), (-1, 6, 7), (-1, -1, 9)], [10, 20, 30])
    ids, probs = store.row((3, 4, 5))
    assert ids.tolist() == [10, 11]
    np.testing.assert_allclose(probs, [0.75, 0.25])
    assert store.row((4, 5))[0].tolist() == [10, 11]
    assert store.row((6, 7))[0].tolist() == [20, 21]
    assert store.row((5, 6, 7)) is None and store.row((9, 9)) is None
    assert store.num_rows == 3  # G(3,4,5), C(4,5), C(6,7); the 1-token context only hits U
    assert [u.row(t)[0].tolist() for t in (5, 7, 9)] == [[10, 11], [20, 21], [30, 31]]
    assert u.row(4) is None and u.num_rows == 3


def test_newer_row_overwrites_in_place() -> None:
    store, u = ContextStore(KW, 64), UnigramTable(50, KW)
    put(store, u, [(-1, 1, 2)], [10])
    put(store, u, [(-1, 1, 2)], [30])
    assert store.row((1, 2))[0].tolist() == [30, 31] and store.num_rows == 1
    assert u.row(2)[0].tolist() == [30, 31]


def test_growth_keeps_every_row() -> None:
    store, u = SmallStore(KW, 4096), UnigramTable(2000, KW)
    contexts = [(-1, i, i + 1) for i in range(1500)]
    for start in range(0, 1500, 100):
        put(store, u, contexts[start:start + 100], list(range(start, start + 100)))
    assert store.num_rows == 1500 and store.ring.shape[0] >= 1500
    assert all(store.row((i, i + 1))[0][0] == i for i in range(1500))
    assert store.nbytes == store.tkeys.nbytes + store.tvals.nbytes + store.ring.nbytes


@settings(max_examples=40, deadline=None)
@given(st.integers(16, 40),
       st.lists(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), min_size=1,
                         max_size=12), min_size=1, max_size=25))
def test_matches_fifo_model(cap: int, batches: list[list[tuple[int, int]]]) -> None:
    """Bounded at `cap`; the oldest-inserted key goes first; an overwrite keeps its age."""
    store, u = SmallStore(KW, cap), UnigramTable(1024, KW)
    model: OrderedDict[tuple[int, int], int] = OrderedDict()
    value = 0
    for batch in batches:
        firsts = []
        for a, b in batch:
            value += 1
            firsts.append(value)
            if (a, b) not in model and len(model) == cap:
                model.popitem(last=False)
            model[(a, b)] = value  # assignment to an existing key keeps its position
        put(store, u, [(-1, a, b) for a, b in batch], firsts)
        assert store.num_rows == len(model) <= cap
    for a in range(8):
        for b in range(8):
            row = store.row((a, b))
            if (a, b) in model:
                assert row is not None and row[0][0] == model[(a, b)]
            else:
                assert row is None
    assert int((store.tkeys != kernels.EMPTY).sum()) == len(model)


def test_context_row_rejects_bad_length() -> None:
    with pytest.raises(ValueError, match="2 \\(C\\) or 3 \\(G\\) tokens"):
        ContextStore(KW, 16).row((1,))


def test_partitions_are_lru_bounded() -> None:
    parts = UnigramPartitions(vocab_size=10, k=KW, max_partitions=2)
    a = parts.get("a")
    parts.get("b")
    assert parts.get("a") is a  # refreshes "a"
    parts.get("c")              # evicts the least recently used: "b"
    assert len(parts) == 2 and "a" in parts and "c" in parts and "b" not in parts
    assert parts.get("b") is not a and len(parts) == 2 and "a" not in parts
    assert all(t.nbytes == 10 * (2 * KW + 1) * 4 for t in parts.tables())



def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_new_unigram_tables_cost_no_memory_until_written() -> None:
    """A client cycling cache salts creates a table per salt inside the engine loop: creation
    must not fill megabytes (it used to write conf = -1 into every row)."""
    before = _rss_bytes()
    tables = [UnigramTable(262_144, 8) for _ in range(8)]  # 8 x 17.8 MB if touched
    grown = _rss_bytes() - before
    assert grown < 16 * 2**20, f"creating 8 tables touched {grown / 2**20:.0f} MiB"
    assert all(t.num_rows == 0 and t.row(5) is None for t in tables)
