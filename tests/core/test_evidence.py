"""Evidence trees (suffix_mode evidence): golden continuations, their length against the
matched context, several candidates, the allowance on top of the budget, one score for all
sources, and each ablation switch."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_recap.core import Drafter, RecapConfig, SuffixMode
from vllm_recap.core import _kernels as K
from vllm_recap.core.calibration import _memory_prior, prior_table
from vllm_recap.core.config import discount_table
from vllm_recap.core.tree import SOURCE_MEMORY, SOURCE_SUFFIX

pytestmark = pytest.mark.unit

PRIOR = prior_table()
TEXT = list(range(1, 20))  # 1 .. 19, each once


def drafter(vocab: int = 60, blocked=(), **kw: object) -> Drafter:
    """Memories empty and frozen calibration: trees come from the suffix automaton alone."""
    cfg = dict(top_k=2, use_context_memories=False, node_budget=1, calibrated_scores=False,
               shared_index="off")
    cfg.update(kw)
    return Drafter(RecapConfig(**cfg), vocab, blocked_token_ids=blocked)


def single(length: int) -> float:
    """Prior of a continuation after a `length`-token context seen once before."""
    return PRIOR[K.MEM_CELLS + int(K._E_BUCKET[min(length, 32)]) * K.SUF_FS + 4]


def propose(d: Drafter, history: list[int], rid: str = "a"):
    d.start(rid, history)
    return d.propose(rid)


def expected_continuation(history_tail_matched: int, text: list[int], limit: int = 16,
                          min_prob: float = 0.1) -> tuple[list[int], list[float]]:
    """Tokens and scores of the continuation of a `matched`-token context seen once before:
    text[matched:], each node's score its parent's times the prior of its context length."""
    tokens, scores, p, length = [], [], 1.0, history_tail_matched
    while len(tokens) < min(limit, len(text) - history_tail_matched):
        if p * single(length) < min_prob:
            break
        p *= single(length)
        tokens.append(text[history_tail_matched + len(tokens)])
        scores.append(p)
        length += 1
    return tokens, scores


def test_golden_continuation_of_a_one_token_match() -> None:
    # "1" occurred once, followed by 2 3 4 ...: P(2) = p(1), P(3) = p(1) p(2), ... >= 0.1.
    t = propose(drafter(), TEXT + [1])
    tokens, scores = expected_continuation(1, TEXT + TEXT[:1])
    assert tokens == [2, 3, 4, 5]  # 0.37, 0.21, 0.14, 0.11, then 0.09 < 0.1
    assert t.tokens.tolist() == [1] + tokens and t.parents.tolist() == [-1, 0, 1, 2, 3]
    np.testing.assert_allclose(t.scores, [1] + scores)
    assert t.sources.tolist() == [0] + [SOURCE_SUFFIX] * 4 and t.chain_len == 4


@pytest.mark.parametrize("matched", [1, 2, 4, 8, 12])
def test_continuations_grow_with_the_matched_context(matched: int) -> None:
    history = TEXT + TEXT[:matched]
    t = propose(drafter(), history)
    tokens, scores = expected_continuation(matched, TEXT + TEXT)
    assert t.best_path().tolist() == tokens
    np.testing.assert_allclose(t.scores[1:len(tokens) + 1], scores)
    if matched >= 4:
        assert len(tokens) > len(propose(drafter(), TEXT + TEXT[:1]).best_path())


def test_golden_several_candidates_ranked_by_recency_on_a_tie() -> None:
    # "7 1" was followed by 2 (position 2) and by 3 (position 5): two branches, 3 first;
    # each then copies its occurrence (contexts of 3, 4, 5 tokens seen once).
    t = propose(drafter(), [7, 1, 2, 7, 1, 3, 7, 1])
    assert t.tokens.tolist() == [1, 3, 7, 1, 2, 7, 1, 3]
    assert t.parents.tolist() == [-1, 0, 1, 2, 0, 4, 5, 6]
    half = PRIOR[K.MEM_CELLS + 1 * K.SUF_FS + 1]  # context of 2 tokens, half agree
    a, b, c = half * single(3), half * single(3) * single(4), 0.0
    c = b * single(5)
    np.testing.assert_allclose(t.scores, [1, half, a, b, half, a, b, c])
    # "7 1 3 7 1" ends at the history's end: nothing followed it yet, so branch 3 stops there.


def test_the_more_frequent_continuation_wins() -> None:
    # "7 1" continued with 2 twice and with 3 once (most recently): 2 leads.
    t = propose(drafter(), [5, 7, 1, 2, 6, 7, 1, 2, 8, 7, 1, 3, 9, 7, 1])
    assert t.best_path().tolist()[0] == 2 and 3 in t.tokens[t.parents == 0].tolist()


def test_min_prob_and_the_allowance_bound_continuations() -> None:
    history = TEXT + TEXT[:10]
    assert propose(drafter(suffix_min_prob=0.95), history).num_drafts == 0  # P(11) = 0.93
    deep = propose(drafter(suffix_min_prob=0.0), history)
    assert deep.best_path().tolist() == (TEXT[10:] + TEXT)[:16] and deep.num_drafts == 16
    capped = propose(drafter(suffix_min_prob=0.0, suffix_len=4), history)
    assert capped.best_path().tolist() == TEXT[10:14]
    assert propose(drafter(suffix_len=0), history).num_drafts == 0


def test_continuations_may_go_deeper_than_max_depth_memory_nodes_not() -> None:
    t = propose(drafter(suffix_min_prob=0.0, max_depth=2, suffix_len=8), TEXT + TEXT[:10])
    assert t.depths.max() == 8  # max(max_depth, suffix_len)


def test_blocked_tokens_stop_a_continuation() -> None:
    t = propose(drafter(suffix_min_prob=0.0, blocked=[14]), TEXT + TEXT[:10])
    assert t.best_path().tolist() == [11, 12, 13]


U_ROWS = {1: ([30, 31], [0.9, 0.1]), 2: ([32, 33], [0.8, 0.2]), 30: ([34, 35], [0.9, 0.1]),
          34: ([36, 37], [0.9, 0.1])}


def with_unigram(d: Drafter, history: list[int], rid: str = "a"):
    """Starts `rid` with `history` (ending in 1) and teaches U the rows above by observing
    two verified steps (which write memories, not history)."""
    d.start(rid, history)
    for tokens in ([1, 30, 34], [1, 2]):
        rows = [U_ROWS[t] for t in tokens]
        d.observe(rid, tokens, list(range(-1, len(tokens) - 1)),
                  np.array([r[0] for r in rows]), np.array([r[1] for r in rows]))
    return d.propose(rid)


@pytest.mark.parametrize("budget", [0, 1, 2, 3])
def test_continuations_add_to_the_budget(budget: int) -> None:
    # Memory candidates 30 -> 34 -> 36 ... from U; the continuation 2 3 4 from the text.
    # Budget 0: the continuation alone (it once gave a root-only tree, so a node_budget of 0
    # drafted nothing where the README promises continuations on top of it).
    t = with_unigram(drafter(node_budget=budget), TEXT + [1])
    memory_only = int(np.sum(t.sources == SOURCE_MEMORY))
    from_suffix = int(np.sum((t.sources & SOURCE_SUFFIX) > 0))
    assert memory_only == budget and from_suffix == len(expected_continuation(1, TEXT)[0])
    assert t.num_drafts == budget + from_suffix


def test_memory_candidates_grow_from_continuation_nodes() -> None:
    # The continuation node 2 has a U row (32: .8): its memory candidate competes for the
    # budget with those under the root's memory chain (30, 34, 36 ...).
    t = with_unigram(drafter(node_budget=4), TEXT + [1])
    two = int(np.flatnonzero(t.tokens == 2)[0])
    kids = t.tokens[t.parents == two].tolist()
    assert 32 in kids and 3 in kids
    assert t.sources[int(np.flatnonzero(t.tokens == 32)[0])] == SOURCE_MEMORY


def test_one_node_for_two_sources_carries_both() -> None:
    # U says 1 -> 2 (.9); the text says 1 -> 2 too: one node, both sources, the larger score.
    d = Drafter(RecapConfig(top_k=2, use_context_memories=False, node_budget=2,
                            calibrated_scores=False, shared_index="off"), 60)
    d.start("a", TEXT + [1])
    d.observe("a", [1], [-1], np.array([[2, 40]]), np.array([[0.9, 0.1]]))
    t = d.propose("a")
    two = int(np.flatnonzero(t.tokens == 2)[0])
    assert t.parents[two] == 0 and t.sources[two] == SOURCE_MEMORY | SOURCE_SUFFIX
    disc = discount_table(RecapConfig().depth_discounts)
    assert t.scores[two] == pytest.approx(max(disc[1] * 0.9, single(1)))
    assert np.sum(t.tokens == 2) == 1


def test_layout_is_best_node_first_after_the_chain() -> None:
    t = with_unigram(drafter(node_budget=3), TEXT + [1])
    rest = t.scores[1 + t.chain_len:]
    assert np.all(np.diff(rest) <= 0)
    assert t.truncate(2).tokens.tolist() == t.tokens[:2].tolist()


# ---------------------------------------------------------------- ablation switches


def test_earliest_mode_is_the_original_insertion() -> None:
    """suffix_mode earliest: the first occurrence's continuation, suffix_len long, no sources."""
    history = [5, 1, 2, 3, 5, 1, 9, 9, 4, 5]  # "5" occurred at 0 and 4: earliest is 0
    t = propose(drafter(suffix_mode="earliest", suffix_len=3), history)
    assert t.tokens.tolist() == [5, 1, 2, 3] and t.sources is None
    ev = propose(drafter(suffix_min_prob=0.0, suffix_len=3), history)
    assert ev.best_path().tolist()[0] == 1 and ev.sources is not None
    assert RecapConfig(suffix_mode="earliest").suffix_mode is SuffixMode.EARLIEST


def test_calibrated_scores_off_uses_the_papers_memory_score() -> None:
    disc = discount_table(RecapConfig().depth_discounts)
    for learn in (False, True):
        d = Drafter(RecapConfig(top_k=2, use_context_memories=False, node_budget=3,
                                suffix_len=0, calibrated_scores=learn), 60)
        t = with_unigram(d, [1])
        if learn:  # the calibration's cells (at their priors: nothing verified yet)
            p1, p2 = _memory_prior(1, 0.9), _memory_prior(2, 0.9)
        else:  # the paper's d(depth) * q
            p1, p2 = disc[1] * 0.9, disc[2] * 0.9
        np.testing.assert_allclose(t.scores[:3], [1, p1, p1 * p2])


def test_sources_survive_truncation_and_repeat_proposals_replace_the_pending_one() -> None:
    d = drafter(node_budget=2)
    t = with_unigram(d, TEXT + [1])
    cut = t.truncate(3)
    assert cut.sources.tolist() == t.sources[:3].tolist()
    # A second proposal before any verification replaces the first: observing the first
    # tree's prefix (not a prefix of the second) teaches nothing.
    second = d.propose("a", node_budget=1)
    assert second.num_nodes != t.num_nodes or second.tokens.tolist() != t.tokens.tolist()
    n = t.num_nodes
    d.observe("a", t.tokens, t.parents, np.zeros((n, 2), np.int64), np.ones((n, 2)))
    d.commit("a", t.best_path().tolist() + [0])
    snap = d.acceptance_snapshot()
    assert sum(sum(v["tested"]) for v in snap.values()) == 0


def test_memory_stats_report_the_shared_index() -> None:
    d = drafter(shared_index="outputs")
    d.start("a", [1, 2])
    d.commit("a", [3, 4, 5])
    d.stop("a")
    stats = d.memory_stats()
    assert stats["index_published"] == 1 and stats["index_tokens"] == 4
    assert stats["index_partitions"] == 1 and stats["index_bytes"] > 0
    off = drafter().memory_stats()  # shared_index off in this helper
    assert off["index_partitions"] == off["index_tokens"] == off["index_bytes"] == 0


def test_a_verified_tree_laid_out_best_first_teaches_the_calibration_alike() -> None:
    """The adaptive budget verifies a best-first layout of (part of) the proposal; the
    calibration must learn from it exactly as from the proposal's own layout, and a subtree
    verified in another layout counts only its own nodes."""
    snaps = []
    for layout in ("proposal", "best_first", "subtree"):
        d = drafter(node_budget=3, calibrated_scores=True)
        t = with_unigram(d, TEXT + [1])
        assert not t.is_chain() and t.num_nodes > 4
        v = {"proposal": t, "best_first": t.best_first(),
             "subtree": t.best_first().truncate(3)}[layout]
        if layout != "proposal":
            assert v.tokens.tolist() != t.tokens[:v.num_nodes].tolist()  # not a prefix
        n = v.num_nodes
        d.observe("a", v.tokens, v.parents, np.zeros((n, 2), np.int64), np.ones((n, 2)))
        d.commit("a", t.best_path().tolist() + [0])
        snaps.append(d.acceptance_snapshot())
    tested = [sum(sum(s["tested"]) for s in snap.values()) for snap in snaps]
    assert snaps[0] == snaps[1] and tested[0] > 0
    assert 0 < tested[2] < tested[0]
