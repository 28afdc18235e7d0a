"""Drafter lifecycle: misuse errors, observe keying, persistence, isolation, determinism."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_recap.core import Drafter, RecapConfig
from vllm_recap.core.memory import ContextStore

pytestmark = pytest.mark.unit

V, KK = 32, 2


def drafter(**kw: object) -> Drafter:
    return Drafter(RecapConfig(top_k=KK, **kw), V)


def rows(n: int, first: int = 1) -> tuple[np.ndarray, np.ndarray]:
    ids = np.array([[(first + i) % V, (first + i + 1) % V] for i in range(n)])
    return ids, np.tile([0.75, 0.25], (n, 1))


# ---------------------------------------------------------------- misuse -> ValueError


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("not a config", 10), "config must be a RecapConfig, got str"),
        ((RecapConfig(), 0), r"vocab_size = 0 must be an int in \[1, 2097152\)"),
        ((RecapConfig(), 1 << 21), r"vocab_size = 2097152 must be an int"),
        ((RecapConfig(), True), r"vocab_size = True must be an int"),
        ((RecapConfig(), 10, [3, 10]), r"blocked_token_ids must lie in \[0, 10\)"),
    ],
)
def test_constructor_errors(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Drafter(*args)


def test_unknown_request_everywhere() -> None:
    d = drafter()
    ids, probs = rows(1)
    for call in (lambda: d.observe("x", [1], [-1], ids, probs), lambda: d.commit("x", [1]),
                 lambda: d.propose("x"), lambda: d.stop("x"), lambda: d.history("x")):
        with pytest.raises(ValueError, match="unknown request 'x'"):
            call()


def test_double_start_and_double_stop() -> None:
    d = drafter()
    d.start("a", [1, 2])
    with pytest.raises(ValueError, match="request 'a' already started"):
        d.start("a", [3])
    d.stop("a")
    with pytest.raises(ValueError, match="unknown request 'a'"):
        d.stop("a")
    d.start("a", [3])  # an id can be reused after stop
    assert d.history("a") == [3]


@pytest.mark.parametrize(
    ("prompt", "prompt_rows", "message"),
    [
        ([], None, "prompt_tokens must not be empty"),
        ([1, V], None, r"prompt_tokens must lie in \[0, 32\)"),
        ([1, -1], None, r"prompt_tokens must lie in \[0, 32\)"),
        ([1, 2], (np.zeros((2, KK)),), r"prompt_rows must be \(ids, probs\)"),
        ([1, 2], (np.zeros((2, 3)), np.ones((2, 3))), r"ids/probs must be \[m, 2\]"),
        ([1, 2], (np.zeros((3, KK)), np.ones((3, KK))), r"positions must lie in \[0, 2\)"),
        ([1, 2], (np.zeros((2, KK)), np.ones((2, KK)), [0]), r"positions must be \[2\]"),
        ([1, 2], (np.zeros((1, KK)), np.ones((1, KK)), [2]), r"positions must lie in \[0, 2\)"),
        ([1, 2], (np.full((1, KK), V), np.ones((1, KK))), "a top-K id is outside"),
        ([1, 2], (np.zeros((1, KK)), -np.ones((1, KK))), "probabilities must be finite"),
    ],
)
def test_start_errors(prompt: list[int], prompt_rows: tuple | None, message: str) -> None:
    d = drafter()
    with pytest.raises(ValueError, match=message):
        d.start("a", prompt, prompt_rows=prompt_rows)
    assert not d.has_request("a")  # a failed start registers nothing


@pytest.mark.parametrize(
    ("tokens", "parents", "ids", "probs", "message"),
    [
        ([5], [-1], np.zeros((1, KK)), np.ones((1, KK)), "node_tokens\\[0\\] = 5 is not the last"),
        ([], [], np.zeros((0, KK)), np.ones((0, KK)), r"expected node_tokens \[n>=1\]"),
        ([2, 3], [-1], np.zeros((2, KK)), np.ones((2, KK)), r"expected node_tokens"),
        ([2, 3], [-1, 0], np.zeros((2, 3)), np.ones((2, 3)), r"topk_probs \[n, 2\]"),
        ([2, 3], [-1, 1], np.zeros((2, KK)), np.ones((2, KK)), "parents must satisfy"),
        ([2, 3], [0, 0], np.zeros((2, KK)), np.ones((2, KK)), "parents must satisfy"),
        ([2, V], [-1, 0], np.zeros((2, KK)), np.ones((2, KK)), "a node token is outside"),
        ([2, 3], [-1, 0], np.full((2, KK), -1), np.ones((2, KK)), "a top-K id is outside"),
        ([2, 3], [-1, 0], np.zeros((2, KK)), np.zeros((2, KK)), "probabilities must be finite"),
        ([2, 3], [-1, 0], np.zeros((2, KK)), np.full((2, KK), np.nan), "must be finite"),
    ],
)
def test_observe_errors_leave_memory_untouched(tokens: list[int], parents: list[int],
                                               ids: np.ndarray, probs: np.ndarray,
                                               message: str) -> None:
    d = drafter()
    d.start("a", [1, 2])
    before = d.unigram_table("a").rows.copy()
    with pytest.raises(ValueError, match=message):
        d.observe("a", tokens, parents, ids, probs)
    np.testing.assert_array_equal(d.unigram_table("a").rows, before)
    assert d.context_store("a").num_rows == 0


def test_commit_and_propose_errors() -> None:
    d = drafter()
    d.start("a", [1, 2])
    with pytest.raises(ValueError, match=r"committed token 32 outside \[0, 32\)"):
        d.commit("a", [3, V])
    assert d.history("a") == [1, 2]
    for kwargs, message in (({"node_budget": -1}, "node_budget = -1 must be an int >= 0"),
                            ({"node_budget": True}, "node_budget = True must be"),
                            ({"node_budget": 2.0}, "node_budget = 2.0 must be"),
                            ({"max_depth": -2}, "max_depth = -2 must be an int >= 0"),
                            ({"max_depth": 65}, "max_depth = 65 must be <= MAX_DEPTH = 64")):
        with pytest.raises(ValueError, match=message):
            d.propose("a", **kwargs)


# ---------------------------------------------------------------- semantics


def test_observe_keys_rows_by_path_context() -> None:
    # History 5 6 7; tree 7 -> 8 -> 9 plus 7 -> 10. Node i's context = history + path to i.
    d = drafter(suffix_len=0)
    d.start("a", [5, 6, 7])
    ids, probs = rows(4, first=20)  # row i = (20 + i, 21 + i)
    d.observe("a", [7, 8, 9, 10], [-1, 0, 1, 0], ids, probs)
    u, ctx = d.unigram_table("a"), d.context_store("a")
    expect = {  # node: (token, C context, G context)
        0: (7, (6, 7), (5, 6, 7)),
        1: (8, (7, 8), (6, 7, 8)),
        2: (9, (8, 9), (7, 8, 9)),
        3: (10, (7, 10), (6, 7, 10)),
    }
    for i, (tok, c2, g3) in expect.items():
        assert u.row(tok)[0].tolist() == [20 + i, 21 + i]
        assert ctx.row(c2)[0].tolist() == [20 + i, 21 + i]
        assert ctx.row(g3)[0].tolist() == [20 + i, 21 + i]
    assert ctx.num_rows == 8
    np.testing.assert_allclose(u.row(7)[1], [0.75, 0.25])


def test_short_history_writes_only_available_keys() -> None:
    d = drafter()
    d.start("a", [4])
    d.observe("a", [4, 6], [-1, 0], *rows(2))
    ctx = d.context_store("a")
    # Root context (4): U only. Node 1 context (4, 6): U and C, no G.
    assert ctx.num_rows == 1 and ctx.row((4, 6)) is not None
    assert d.unigram_table("a").row(4) is not None and d.unigram_table("a").row(6) is not None


def test_rows_written_after_the_context_table_grew_are_used() -> None:
    d = drafter(suffix_len=0)
    d.start("a", [1, 5, 6])
    n = 200  # 2 n new keys > the initial rows: observe grows the C/G table before writing
    d.observe("a", [6] + [3 + i % 29 for i in range(n)], list(range(-1, n)), *rows(n + 1))
    store = d.context_store("a")
    assert store.ring.shape[0] > ContextStore.INITIAL_ROWS
    # Root 6 after (1, 5): G, C and U get (10, 11); node 1 (6 again) overwrites U[6] only.
    d.observe("a", [6, 6], [-1, 0], np.array([[10, 11], [20, 21]]), np.tile([0.75, 0.25], (2, 1)))
    assert store is d.context_store("a") and store.row((5, 6))[0].tolist() == [10, 11]
    assert d.unigram_table("a").row(6)[0].tolist() == [20, 21]
    assert d.propose("a").draft_tokens[0] == 10  # found C and G in the grown table


def test_prompt_rows_with_positions_subset() -> None:
    d = drafter()
    ids, probs = rows(2, first=10)
    d.start("a", [3, 4, 5, 6], prompt_rows=(ids, probs, [1, 3]))
    u, ctx = d.unigram_table("a"), d.context_store("a")
    assert u.row(4)[0].tolist() == [10, 11] and u.row(6)[0].tolist() == [11, 12]
    assert u.row(3) is None and u.row(5) is None
    assert ctx.row((3, 4))[0].tolist() == [10, 11] and ctx.row((4, 5, 6))[0].tolist() == [11, 12]
    assert ctx.row((3, 4, 5)) is None


def test_prompt_rows_default_positions_are_the_first_rows() -> None:
    d = drafter()
    d.start("a", [3, 4, 5], prompt_rows=rows(2, first=10))
    u = d.unigram_table("a")
    assert u.row(3)[0].tolist() == [10, 11] and u.row(4)[0].tolist() == [11, 12]
    assert u.row(5) is None


def test_lifecycle_bookkeeping() -> None:
    d = drafter()
    d.start("a", [1, 2])
    d.start("b", [3], salt="s")
    assert d.num_requests == 2 and d.has_request("a") and not d.has_request("c")
    d.commit("a", np.array([3, 4]))
    assert d.history("a") == [1, 2, 3, 4]
    stats = d.memory_stats()
    assert stats["requests"] == 2 and stats["u_partitions"] == 2 and stats["u_tables"] == 2
    assert stats["u_bytes"] == 2 * V * (2 * KK + 1) * 4 and stats["history_tokens"] == 5
    assert stats["context_bytes"] > 0 and stats["context_rows"] == 0
    d.stop("a")
    d.stop("b")
    assert d.num_requests == 0 and d.memory_stats()["context_bytes"] == 0


def test_budget_zero_drafts_continuations_only_and_depth_zero_nothing() -> None:
    """node_budget 0 = no memory nodes, continuations still on top of it (suffix_mode
    evidence); root only where there are no continuations (suffix_len 0, or the earliest
    mode, whose continuation is inserted into a memory tree) and at max_depth 0."""
    for kw, continuation in (({}, [1, 2]), ({"suffix_len": 0}, []),
                             ({"suffix_mode": "earliest"}, [])):
        d = drafter(**kw)
        d.start("a", [1, 2, 1, 2])
        d.observe("a", [2], [-1], *rows(1, first=1))
        assert d.propose("a").num_drafts > 0
        t = d.propose("a", node_budget=0)
        assert t.tokens.tolist() == [2, *continuation], kw  # the history's 2 -> 1 -> 2
        assert t.best_path().tolist() == continuation
        assert d.propose("a", max_depth=0).tokens.tolist() == [2]
        assert d.propose("a", node_budget=1).num_drafts <= 1 + 16


def test_matched_length_is_the_longest_recurring_suffix_of_own_or_shared_text() -> None:
    """What the driver's idle steps watch (a continuation's evidence, no tree built): the
    longest suffix of the history that occurred before in it, or in the shared index."""
    d = drafter()
    d.start("a", [5, 6, 7, 8])
    assert d.matched_length("a") == 0
    d.commit("a", [5, 6])
    assert d.matched_length("a") == 2  # 5 6 occurred at the start
    d.commit("a", [7])
    assert d.matched_length("a") == 3
    d.commit("a", [9])
    assert d.matched_length("a") == 0
    d.commit("a", [1, 2, 3, 4])
    d.stop("a")  # publishes its text to the shared index
    d.start("b", [30, 1, 2, 3])
    assert d.matched_length("b") == 3  # 1 2 3 occurred in "a"'s output
    d2 = drafter(shared_index="off")
    d2.start("c", [30, 1, 2, 3])
    assert d2.matched_length("c") == 0


# ---------------------------------------------------------------- persistence / isolation


def _teach(d: Drafter, rid: str, token: int, row_first: int) -> None:
    """Request `rid` (history ending in `token`) observes a row for `token`."""
    d.observe(rid, [token], [-1], *rows(1, first=row_first))


def test_unigram_persists_per_salt() -> None:
    d = drafter(suffix_len=0)
    d.start("a", [9], salt="x")
    _teach(d, "a", 9, 20)
    d.stop("a")
    d.start("b", [9], salt="x")
    assert d.propose("b").draft_tokens[:2].tolist() == [20, 21]
    d.start("c", [9], salt="y")
    d.start("e", [9])
    assert d.propose("c").num_drafts == 0 and d.propose("e").num_drafts == 0


def test_unigram_reset_per_request_when_not_persistent() -> None:
    d = drafter(suffix_len=0, persistent_unigram=False)
    d.start("a", [9])
    _teach(d, "a", 9, 20)
    assert d.propose("a").num_drafts > 0
    d.start("b", [9])
    assert d.propose("b").num_drafts == 0
    assert d.memory_stats()["u_partitions"] == 0 and d.memory_stats()["u_tables"] == 2


def test_partitions_bounded() -> None:
    d = drafter(max_partitions=2)
    for i in range(5):
        d.start(f"r{i}", [1], salt=f"s{i}")
        d.stop(f"r{i}")
    assert d.memory_stats()["u_partitions"] == 2 and d.memory_stats()["u_tables"] == 2


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 7), min_size=1, max_size=4)),
                min_size=1, max_size=12))
def test_context_rows_never_visible_to_another_request(
        steps: list[tuple[bool, list[int]]]) -> None:
    """C/G keys of each request are exactly those of its own observed contexts."""
    d = drafter(persistent_unigram=False)
    hist = {"a": [1, 2], "b": [3, 4]}
    keys: dict[str, set[tuple[int, ...]]] = {"a": set(), "b": set()}
    for rid in hist:
        d.start(rid, hist[rid])
    for to_a, chain in steps:
        rid = "a" if to_a else "b"
        tokens = [hist[rid][-1]] + chain  # a chain tree rooted at the history's last token
        parents = list(range(-1, len(chain)))
        d.observe(rid, tokens, parents, *rows(len(tokens)))
        ctx = hist[rid] + chain
        for end in range(len(hist[rid]) - 1, len(ctx)):
            keys[rid].add(tuple(ctx[end - 1:end + 1]))
            if end >= 2:
                keys[rid].add(tuple(ctx[end - 2:end + 1]))
        hist[rid].append(chain[0])
        d.commit(rid, [chain[0]])
    for rid, other in (("a", "b"), ("b", "a")):
        store = d.context_store(rid)
        assert store.num_rows == len(keys[rid])
        assert all(store.row(key) is not None for key in keys[rid])
        assert all(store.row(key) is None for key in keys[other] - keys[rid])


def test_proposals_of_one_request_ignore_another_requests_activity() -> None:
    def run(with_other: bool) -> list[list[int]]:
        d = drafter(persistent_unigram=False)
        d.start("b", [1, 2, 3])
        if with_other:
            d.start("a", [1, 2, 3])
        out = []
        for step in range(6):
            if with_other:
                root = d.history("a")[-1]
                d.observe("a", [root, 5, 6], [-1, 0, 1], *rows(3, first=step + 10))
                d.commit("a", [5])
            root = d.history("b")[-1]
            d.observe("b", [root, 7], [-1, 0], *rows(2, first=step))
            out.append(d.propose("b").tokens.tolist())
            d.commit("b", [7])
        return out

    assert run(True) == run(False)
