"""Acceptance calibration: priors, what counts as tested and held, convergence, the memory
rows' monotonicity, the learning switch, and the Drafter's bookkeeping around it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_recap.core import Drafter, RecapConfig, SourceCalibration
from vllm_recap.core import _kernels as K
from vllm_recap.core.calibration import CELL_CAP, PRIOR_WEIGHT, prior_table
from vllm_recap.core.config import MAX_DEPTH

pytestmark = pytest.mark.unit

def suffix_cell(src: int, length_bucket: int, agreement: int) -> int:
    return K.MEM_CELLS + src * K.SUF_CELLS + length_bucket * K.SUF_FS + agreement


def test_priors() -> None:
    prior = prior_table()
    assert prior.shape == (K.N_CELLS,)
    assert np.all((prior > 0) & (prior < 1))
    mem = prior[:K.MEM_CELLS].reshape(K.MEM_RIVALS, K.MEM_DEPTHS, K.MEM_QS)
    assert np.all(np.diff(mem, axis=2) > 0)  # a more probable fused candidate is worth more
    assert np.all(np.diff(mem[0], axis=0) >= 0)  # deeper: the parent held, more predictable
    # only one child holds: a memory candidate next to a strong rival continuation is worth
    # less than next to a weak one, or none
    assert np.all(mem[2] < mem[1]) and np.all(mem[1] < mem[0])
    np.testing.assert_allclose(mem[0, 0], 0.65 * (np.arange(K.MEM_QS) + 0.5) / K.MEM_QS)
    rows = prior[K.MEM_CELLS:K.MEM_CELLS + K.SUF_CELLS].reshape(K.SUF_ES, K.SUF_FS)
    assert np.all(np.diff(rows, axis=0) > 0)  # a longer matched context is worth more
    assert np.all(np.diff(rows[:, :4], axis=1) > 0)  # so is more agreement
    assert np.all(np.diff(rows[:, 4:], axis=1) > 0)  # and more agreeing occurrences
    assert rows[0, 4] == pytest.approx(0.37) and rows[-1, 4] > 0.9
    shared = prior[K.MEM_CELLS + K.SUF_CELLS:].reshape(K.SUF_ES, K.SUF_FS)
    assert np.all(shared < rows) and np.all(np.diff(shared / rows, axis=0) > 0)


# A hand-made proposal: root 0 -> a (1), b (2); a -> c (3); memory cells for a and b, a
# suffix cell for c.
TOKENS = np.array([9, 10, 11, 12], np.int64)
PARENTS = np.array([-1, 0, 0, 1], np.int64)
DEPTHS = np.array([0, 1, 1, 2], np.int64)
CELL_A, CELL_B, CELL_C = 5, 3, suffix_cell(0, 2, 4)
FEATS = np.array([[-1, CELL_A, CELL_B, -1], [-1, -1, -1, CELL_C], [-1, -1, -1, -1]], np.int64)


@pytest.mark.parametrize(("committed", "n", "accepted", "memory", "suffix"), [
    # a and c accepted, then the bonus: a, b tested at depth 1 (a held); c tested and held.
    ([10, 12, 7], 4, 2, (2, 1), (1, 1)),
    # b accepted: c's parent was rejected, so c says nothing.
    ([11, 7], 4, 1, (2, 1), (0, 0)),
    # nothing accepted: the bonus token is the target's own, not a draft.
    ([10], 4, 0, (2, 0), (0, 0)),
    # only the first two nodes were verified: a held, c was never verified.
    ([10, 7], 2, 1, (1, 1), (0, 0)),
])
def test_tested_and_held(committed: list[int], n: int, accepted: int, memory: tuple,
                         suffix: tuple) -> None:
    cal = SourceCalibration()
    got = cal.learn_step(TOKENS, PARENTS, DEPTHS, FEATS, n, np.array(committed, np.int64))
    assert got == accepted
    snap = cal.snapshot()
    assert (sum(snap["memory"]["tested"]), sum(snap["memory"]["held"])) == memory
    assert (sum(snap["suffix"]["tested"]), sum(snap["suffix"]["held"])) == suffix
    assert snap["memory"]["tested"][0] == memory[0]  # all at depth 1
    assert sum(snap["shared"]["tested"]) == 0
    row_c = K._cell_row(CELL_C)  # learning pools a row of cells: holds vs prior-expected
    assert cal.stats[0, row_c] == suffix[1]
    assert cal.stats[1, row_c] == pytest.approx(suffix[0] * cal.prior[CELL_C])


def test_a_row_converges_to_its_rate_and_keeps_a_window() -> None:
    cal = SourceCalibration()
    rng = np.random.default_rng(0)
    for _ in range(3000):
        held = rng.random() < 0.8
        cal.learn_step(TOKENS, PARENTS, DEPTHS, FEATS, 4,
                       np.array([10, 12, 7] if held else [10, 5], np.int64))
    assert abs(cal.cell_rate(CELL_C) - 0.8) < 0.06
    assert cal.stats[1, K._cell_row(CELL_C)] <= CELL_CAP
    # Drift: the cell now never holds; the window forgets the old rate within ~CELL_CAP tests.
    for _ in range(int(2 * CELL_CAP)):
        cal.learn_step(TOKENS, PARENTS, DEPTHS, FEATS, 4, np.array([10, 5], np.int64))
    assert cal.cell_rate(CELL_C) < 0.25


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, K.MEM_CELLS - 1), st.booleans()), max_size=400))
def test_memory_rows_stay_non_decreasing_in_q(observations: list[tuple[int, bool]]) -> None:
    cal = SourceCalibration()
    for cell, held in observations:
        feats = np.array([[-1, cell], [-1, -1], [-1, -1]], np.int64)
        cal.learn_step(TOKENS[:2], PARENTS[:2], DEPTHS[:2], feats, 2,
                       np.array([10, 7] if held else [5], np.int64))
    rows = cal.table[:K.MEM_CELLS].reshape(K.MEM_ROWS, K.MEM_QS)
    assert np.all(np.diff(rows, axis=1) >= 0)
    assert np.all((cal.table > 0) & (cal.table < 1))


def test_learning_off_keeps_the_priors_but_counts() -> None:
    cal = SourceCalibration(learn=False)
    before = cal.table.copy()
    for _ in range(50):
        cal.learn_step(TOKENS, PARENTS, DEPTHS, FEATS, 4, np.array([10, 12, 7], np.int64))
    np.testing.assert_array_equal(cal.table, before)
    assert cal.table[CELL_C] == pytest.approx(cal.prior[CELL_C])
    assert cal.snapshot()["suffix"]["tested"] == [0, 50]
    assert cal.kernel_args()[1] is False


def test_snapshot_layout() -> None:
    cal = SourceCalibration()
    assert cal.snapshot() == {s: {"tested": [], "held": [], "rate": [], "predicted": []}
                              for s in ("memory", "suffix", "shared")}
    cal.learn_step(TOKENS, PARENTS, DEPTHS, FEATS, 4, np.array([10, 12, 7], np.int64))
    snap = cal.snapshot()
    assert snap["memory"] == {"tested": [2, 0], "held": [1, 0], "rate": [0.5, 0.0],
                              "predicted": [round((cal.prior[CELL_A] + cal.prior[CELL_B]) / 2, 3),
                                            0.0]}
    assert snap["suffix"]["rate"] == [0.0, 1.0]
    assert cal.counters.shape == (3, 3, MAX_DEPTH + 1) and PRIOR_WEIGHT > 0


# ---------------------------------------------------------------- through the Drafter


def repeating_drafter(**kw: object) -> tuple[Drafter, list[int]]:
    cfg = dict(top_k=2, use_context_memories=False, node_budget=1, shared_index="off")
    cfg.update(kw)
    d = Drafter(RecapConfig(**cfg), 50)
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    d.start("a", text + text[:3])  # "1 2 3" matched: the continuation is 4 5 6 ...
    return d, text


def test_commit_after_observe_teaches_the_calibration() -> None:
    d, _ = repeating_drafter()
    tree = d.propose("a")
    assert tree.best_path().tolist()[:1] == [4]
    n = tree.num_nodes
    d.observe("a", tree.tokens, tree.parents, np.zeros((n, 2), np.int64), np.ones((n, 2)))
    accepted = tree.best_path().tolist()
    d.commit("a", accepted + [0])
    snap = d.acceptance_snapshot()
    assert snap["suffix"]["held"][:len(accepted)] == [1] * len(accepted)
    assert sum(snap["suffix"]["tested"]) >= len(accepted)


def test_no_learning_without_a_matching_observe() -> None:
    d, _ = repeating_drafter()
    tree = d.propose("a")
    d.commit("a", [4, 5])  # a catch-up commit: nothing was verified
    assert sum(d.acceptance_snapshot()["suffix"]["tested"]) == 0
    tree = d.propose("a")
    root = int(tree.tokens[0])
    # A verified tree that is not the proposal's prefix (another token at node 1).
    d.observe("a", [root, 49], [-1, 0], np.zeros((2, 2), np.int64), np.ones((2, 2)))
    d.commit("a", [49, 1])
    assert sum(d.acceptance_snapshot()["suffix"]["tested"]) == 0
    # A root-only step (nothing drafted) neither.
    d.propose("a", max_depth=0)
    d.observe("a", [1], [-1], np.zeros((1, 2), np.int64), np.ones((1, 2)))
    d.commit("a", [2])
    assert sum(d.acceptance_snapshot()["suffix"]["tested"]) == 0


def test_continuations_that_hold_grow_longer() -> None:
    """The calibrated probability of a reliable source rises, so its continuations run
    deeper than the prior allows; with calibrated_scores off they stay at the prior."""
    depths = {}
    for learn in (True, False):
        d = Drafter(RecapConfig(top_k=2, use_context_memories=False, node_budget=1,
                                shared_index="off", calibrated_scores=learn,
                                suffix_min_prob=0.6), 500)
        period = list(range(100, 160))
        d.start("a", period + period[:2])
        first = d.propose("a").num_drafts
        hist = period + period[:2]
        for _ in range(60):
            tree = d.propose("a")
            n = tree.num_nodes
            d.observe("a", tree.tokens, tree.parents, np.zeros((n, 2), np.int64),
                      np.ones((n, 2)))
            nxt = [period[(len(hist) + i) % len(period)] for i in range(tree.chain_len + 1)]
            accepted = []
            for tok in nxt[:-1]:
                if len(accepted) < tree.chain_len and tree.best_path()[len(accepted)] == tok:
                    accepted.append(tok)
                else:
                    break
            new = accepted + [period[(len(hist) + len(accepted)) % len(period)]]
            d.commit("a", new)
            hist += new
        depths[learn] = (first, d.propose("a").num_drafts)
    # A 2-token context (0.56) is below min_prob 0.6 at first; the priors then allow ~10
    # nodes once the matched context is long, the learned rates (~1) the whole allowance.
    assert depths[True][0] == depths[False][0] == 0
    assert depths[True][1] == 17 and depths[False][1] < depths[True][1]
