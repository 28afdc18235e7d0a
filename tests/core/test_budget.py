"""The budget controller: measured step cost against calibrated expected gains."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_recap.core.budget import AcceptanceCalibration, BudgetController, Drain, StepCostModel
from vllm_recap.core.config import MAX_DEPTH, RecapConfig
from vllm_recap.core.tree import SOURCE_MEMORY, SOURCE_SUFFIX, DraftTree

pytestmark = pytest.mark.unit

DISCOUNTS = (0.68, 0.63, 0.50, 0.43, 0.40, 0.38)


def chain_tree(n: int, score: float) -> DraftTree:
    """A chain of n drafts whose builder scores decay like a confident RECAP chain."""
    scores = np.array([1.0] + [score ** (i + 1) * np.prod(DISCOUNTS[:min(i + 1, 6)])
                               for i in range(n)])
    return DraftTree(np.arange(n + 1), np.arange(-1, n), scores)


def test_cost_model_buckets_averages_interpolates_and_extrapolates():
    m = StepCostModel(ema=0.5)
    assert m.estimate(5) is None
    m.observe(1, 0.10)
    m.observe(1, 0.20)
    assert m.estimate(1) == pytest.approx(0.15)
    assert m.estimate(9) == pytest.approx(0.15)  # unmeasured larger size: as cheap as smaller
    m.observe(9, 0.30)
    # beyond the largest: grows by the slope of the measured sizes (0.15 s per 8 tokens)
    assert m.estimate(12) == pytest.approx(0.30 + 3 * 0.15 / 8)
    assert m.estimate(5) == pytest.approx(0.225)  # between measured sizes: interpolated
    m.observe(12, 0.12)  # a larger size measured cheaper: smaller sizes cost no more
    assert m.estimate(1) == pytest.approx(0.12) and m.estimate(9) == pytest.approx(0.12)
    m.observe(1, 0.05)  # a contradicted average is replaced, not blended
    assert m.estimate(1) == pytest.approx(0.05)
    for _ in range(70):
        m.observe(12, 0.12)
    m.observe(9, 0.11)  # so is a stale one (9 was last measured 70 steps ago)
    assert m.estimate(9) == pytest.approx(0.11)
    assert StepCostModel.bucket(100) == StepCostModel.bucket(103)
    assert m.is_stale(4) and not m.is_stale(12)


def test_a_measured_prefill_size_does_not_make_drafting_look_free_under_load():
    """16 decoding requests; a prefill step of 200 tokens measured, 32 tokens never: the
    cost of 16 + 16 drafts is interpolated, not taken from 16 tokens (which chose drafts)."""
    ctl = _controller_after({16: 0.10, 200: 1.0}, accept=0.3)
    trees = [chain_tree(16, 0.3) for _ in range(16)]
    assert ctl.choose(trees, fixed_tokens=0) == 0


def test_unmeasured_drafts_under_load_cost_what_more_decode_tokens_cost():
    """Concurrency 16: decode steps of 3 to 16 tokens measured (each token ~1.4 ms more),
    one big prefill step, no drafted step yet. Draft tokens are priced by that slope, not as
    free (the plain cost of 16 tokens, extrapolated flat), so first drafts accepted 40% of the
    time are not worth a step's extra tokens and the controller does not draft."""
    ctl = BudgetController(16, DISCOUNTS)
    ctl.observe_step(1600, 1.3)  # the first wave's prefill (no decode context)
    for n in range(3, 17):
        ctl.observe_step(n, 0.025 + 0.0014 * n, context=300)
    tree = chain_tree(16, 0.5)
    for i in range(40):  # the first draft is accepted 40% of the time, deeper ones never
        ctl.calibration().observe(np.arange(17), tree.scores, np.arange(1, 1 + (i % 5 < 2)))
    assert ctl.cost.estimate(24, 300, drafts=8) == pytest.approx(
        0.025 + 0.0014 * StepCostModel.bucket(24))
    assert ctl.choose([tree] * 16, fixed_tokens=0, context=300) == 0


def test_calibration_prior_undoes_discounts_and_learns():
    c = AcceptanceCalibration(DISCOUNTS, prior_nodes=1.0, decay=1.0, prior_depth_mass=1.0)
    assert c.factors()[:, 1] == pytest.approx(np.full(c.factors().shape[::2], 1 / 0.68))
    assert c.prior.shape == (MAX_DEPTH + 1,) and c.prior[0] == 1.0
    assert c.prior[7] == pytest.approx(1 / (np.prod(DISCOUNTS) * DISCOUNTS[-1]))  # d repeats
    tree = chain_tree(3, 0.5)
    depths = np.arange(4)
    for _ in range(50):  # the first draft is always accepted, deeper ones never
        c.observe(depths, tree.scores, accepted=np.array([1]))
    p = c.node_probabilities(depths, tree.parents, tree.scores)
    assert p[1] > 0.9 and p[2] < 0.1
    assert np.all(np.diff(p) <= 0)  # a child is never likelier than its parent


def _sourced(tree: DraftTree, source: int) -> DraftTree:
    """``tree`` with every draft node proposed by ``source`` (root 0)."""
    sources = np.full(tree.num_nodes, source, np.int64)
    sources[0] = 0
    return DraftTree(tree.tokens, tree.parents, tree.scores, depths=tree.depths, sources=sources)


def test_calibration_is_kept_per_node_source():
    """Nodes of the same depth and score from different sources are accepted at different
    rates (measured at concurrency 4: memory-only nodes 0.29x their calibrated estimate, the
    request's own continuations 0.82x, when one factor served both): each source learns its
    own factor, and untracked trees get every source's pooled one."""
    ctl = BudgetController(8, DISCOUNTS)
    tree = chain_tree(2, 0.5)
    memory, suffix = _sourced(tree, SOURCE_MEMORY), _sourced(tree, SOURCE_SUFFIX)
    for i in range(200):  # memory's first node accepted 1 time in 10, the suffix's 9 in 10
        for t, hit in ((memory, i % 10 == 0), (suffix, i % 10 != 0)):
            ctl.observe_tree(t.parents, t.scores, int(hit), t.depths, sources=t.sources)
    p_memory = float(ctl.expected_gains(memory)[1])
    p_suffix = float(ctl.expected_gains(suffix)[1])
    p_untracked = float(ctl.expected_gains(tree)[1])
    assert p_memory == pytest.approx(0.1, abs=0.03)
    assert p_suffix == pytest.approx(0.9, abs=0.03)
    assert p_memory < p_untracked < p_suffix
    # the controller drafts the continuation and not the memory guess of the same score
    for n in range(1, 4):
        ctl.observe_step(n, 0.030 + 0.004 * (n - 1))
    assert ctl.choose([suffix], fixed_tokens=0) >= 1
    assert ctl.choose([memory], fixed_tokens=0) == 0


def test_a_depth_without_data_inherits_what_the_depth_above_learned():
    """Deep nodes are rare, so their factors rest on the prior: a source whose scores
    overrated its nodes tenfold at depths 1-3 is not taken at its raw scores at depth 5
    (measured at batch 1: memory-only nodes of depth 4 and more were accepted 0.11x as often
    as estimated when the prior was the raw score, 0.79x with the depth above carried down)."""
    c = AcceptanceCalibration(DISCOUNTS)
    depths, parents = np.arange(4), np.arange(-1, 3)
    scores = np.array([1.0, 0.5, 0.3, 0.2])
    sources = np.array([0, SOURCE_MEMORY, SOURCE_MEMORY, SOURCE_MEMORY])
    for i in range(400):  # each node accepted a tenth as often as its score says
        hits = [d for d in (1, 2, 3) if (i * 7 + d) % 100 < 100 * scores[d] / 10]
        c.observe(depths, scores, np.array(hits, np.int64), sources)
    f = c.factors()[SOURCE_MEMORY]  # [depths, bins]; depth 5 saw no node
    s = int(np.searchsorted(AcceptanceCalibration.EDGES, 0.2, side="right"))
    assert f[3, s] * 0.2 == pytest.approx(0.2 / 10, rel=0.3)  # depth 3: learned
    assert f[5, s] < c.prior[5] / 4  # not the raw prior
    # (a node is never likelier than its parent, but a confident parent caps nothing)


def test_observe_tree_derives_depths_when_not_given():
    tree = DraftTree(np.arange(5), np.array([-1, 0, 1, 0, 3]), np.array([1, .5, .3, .4, .2]))
    given, derived = BudgetController(8, DISCOUNTS), BudgetController(8, DISCOUNTS)
    given.observe_tree(tree.parents, tree.scores, 2, tree.depths)
    derived.observe_tree(tree.parents, tree.scores, 2)
    np.testing.assert_array_equal(given.calibration().mass, derived.calibration().mass)
    assert given.calibration().mass[0].sum(axis=1)[1:3].tolist() == pytest.approx([0.9, 0.5])


def _controller_after(costs: dict[int, float], accept: float, steps: int = 40) -> BudgetController:
    ctl = BudgetController(16, DISCOUNTS)
    for n, sec in costs.items():
        ctl.observe_step(n, sec)
    tree = chain_tree(16, accept)
    depths = np.arange(17)
    for _ in range(steps):
        accepted = int(np.sum(np.cumprod(np.full(16, accept)) > 0.5))
        ctl.calibration().observe(depths, tree.scores, np.arange(1, accepted + 1))
    return ctl


def test_flat_cost_and_good_drafts_use_the_whole_budget():
    ctl = _controller_after({n: 0.010 for n in range(1, 18)}, accept=0.95)
    assert ctl.choose([chain_tree(16, 0.95)], fixed_tokens=0) == 16


def test_steep_cost_and_poor_drafts_stop_speculating():
    ctl = _controller_after({n: 0.010 * n for n in range(1, 18)}, accept=0.3)
    assert ctl.choose([chain_tree(16, 0.3)], fixed_tokens=0) == 0


def test_explain_says_what_the_last_choice_weighed() -> None:
    """The DEBUG line an operator reads to see why RECAP does or does not draft."""
    cold = BudgetController(16, DISCOUNTS)
    assert cold.choose([chain_tree(16, 0.9)], fixed_tokens=0) == 0
    assert cold.explain().startswith("declined: a plain step of 1 token has no price")
    good = _controller_after({n: 0.010 for n in range(1, 18)}, accept=0.95)
    good.choose([chain_tree(16, 0.95)], fixed_tokens=0)
    assert good.explain().startswith("chose 16 nodes as trees; plain 10.0 ms, 100.0 tokens/s; "
                                     "best draft 16 nodes as trees: 10.0 ms for +")
    poor = _controller_after({n: 0.010 * n for n in range(1, 18)}, accept=0.3)
    poor.choose([chain_tree(16, 0.3)], fixed_tokens=0)
    text = poor.explain()
    assert text.startswith("chose no drafts; plain 10.0 ms, 100.0 tokens/s; best draft ")
    assert text.endswith("tokens/s (must beat plain x1.03)")
    # the rate it quotes for the best draft is below plain decoding's, as it must be
    assert float(text.split("tokens, ")[1].split(" ")[0]) < 100.0 * 1.03
    # every 8th step a neighbouring size that was never measured is re-measured instead
    for _ in range(24 - good.cost.steps):
        good.observe_step(1, 0.010)
    assert good.choose([chain_tree(16, 0.95)], fixed_tokens=0) == 12
    assert good.explain().startswith(
        "chose 12 nodes as trees (re-measuring; the rates picked 16 nodes as trees); ")


def test_cpu_like_cliff_picks_a_middle_budget_when_drafts_are_good():
    costs = {1: 0.10, 2: 0.10, 3: 0.12, 4: 0.12, 5: 0.17, 7: 0.2, 9: 0.2, 13: 0.22, 17: 0.3}
    ctl = _controller_after(costs, accept=0.9)
    b = ctl.choose([chain_tree(16, 0.9)], fixed_tokens=0)
    assert 3 <= b <= 12


def test_no_measurement_yet_means_plain_decoding():
    ctl = BudgetController(16, DISCOUNTS)
    assert ctl.choose([chain_tree(16, 0.9)], fixed_tokens=0) == 0


def test_a_batch_size_between_two_measured_ones_is_priced_without_its_own_measurement():
    """At concurrency 4 a step of 3 decodes follows a request's finish, and the step after it
    runs its replacement's prefill chunk too: plain 3-token steps are never measured, and
    requiring their own measurement declined every draft there (32 of ~300 proposing steps
    in one run). Between two measured sizes the interpolated cost is a measured price."""
    costs = {n: 0.020 + 0.0002 * n for n in (1, 4, 8, 12, 16, 20, 24, 32, 40, 48, 56)}
    ctl = _controller_after(costs, accept=0.95)
    trees = [chain_tree(16, 0.95)] * 3
    assert not ctl.cost.measured(3)
    assert ctl.choose(trees, fixed_tokens=0) > 0 and ctl.cost.priced(3)
    # below the smallest or above the largest measured size it stays unpriced
    assert not ctl.cost.priced(64) and not BudgetController(16, DISCOUNTS).cost.priced(3)
    ctl.observe_step(4, 0.03, context=300)  # another context bucket: its own sizes count
    assert not ctl.cost.priced(3, context=300)


def test_a_batch_whose_context_moves_to_the_next_bucket_is_priced_from_the_one_it_left():
    """Under load the batch's mean context moves into another log2 bucket whenever a request
    arrives, finishes or grows past a boundary. The sizes measured in the bucket it left were
    not yet measured in the new one, and a drafting batch measures plain steps only when it
    declines, so every crossing declined at least twice (20 of 287 proposing steps at
    concurrency 4 with sizes between measured ones priced, Intel Xeon, bf16 SmolLM2). Now an
    adjacent bucket measured on both sides of the size prices it while the new bucket has
    nothing there; once the new bucket has a size of its own, other sizes are priced at its
    level, scaled by any decode bucket's shape. A level from a bucket further away is no
    price."""
    costs = {n: 0.020 + 0.0002 * n for n in (1, 4, 8, 12, 16, 20, 24, 32, 40, 48, 56)}
    ctl = BudgetController(16, DISCOUNTS)
    for n, sec in costs.items():
        ctl.observe_step(n, sec, context=300)  # bucket 8
    tree = chain_tree(16, 0.95)
    for _ in range(40):
        ctl.calibration().observe(np.arange(17), tree.scores, np.arange(1, 17))
    assert ctl.choose([tree] * 4, fixed_tokens=0, context=300) > 0
    # the batch moves to bucket 9, nothing measured there yet: priced from bucket 8
    assert ctl.cost.priced(4, context=700) and ctl.cost.estimate(4, 700) == costs[4]
    assert ctl.choose([tree] * 4, fixed_tokens=0, context=700) > 0
    # one size measured in bucket 9 (10% dearer); a request finishes: 3 decodes are priced
    # at the new bucket's 4-token cost, shrunk as 3 tokens cost less than 4 in bucket 8
    ctl.observe_step(4, 1.1 * costs[4], context=700)
    assert ctl.cost.priced(3, context=700) and not ctl.cost.measured(3, context=700)
    shrunk = np.interp(3, [1, 4], [costs[1], costs[4]]) / costs[4]
    assert ctl.cost.estimate(3, 700) == pytest.approx(1.1 * costs[4] * shrunk)
    assert ctl.choose([tree] * 3, fixed_tokens=0, context=700) > 0
    # two buckets away (context 1500 -> bucket 11) plain decoding is measured first
    assert not ctl.cost.priced(4, context=1500)
    assert ctl.choose([tree] * 4, fixed_tokens=0, context=1500) == 0
    # once bucket 11 has a size of its own, smaller ones take their shape from any decode
    # bucket measured on both sides (here bucket 8): the level is this context's own
    ctl.observe_step(4, 0.03, context=1500)
    assert ctl.cost.priced(3, context=1500)
    assert ctl.cost.estimate(3, 1500) == pytest.approx(0.03 * shrunk)
    # the shape does not come from prefill-only steps (context bucket 0)
    lone = StepCostModel()
    for n in (1, 4, 8):
        lone.observe(n, 0.02 + 0.001 * n)
    lone.observe(4, 0.03, context=700)
    assert not lone.priced(3, context=700)


def test_a_size_below_the_nearest_lenders_measurements_is_priced_by_a_bucket_that_measured_it():
    """The decision log at concurrency 8 (Intel Xeon, bf16 SmolLM2): a batch of 4 decodes at
    context 268 (bucket 8, smallest size measured 8) took its shape from bucket 9, the
    nearest one measured on both sides of 8 -- but bucket 9 had measured down to 6 only, so
    4 was no price and the budget declined, while bucket 7 had measured 1 to 240. The
    bucket measured furthest down lends the shape now (chosen without looking at the size,
    so estimates stay monotone)."""
    def cost(n, context):
        return 0.02 + 0.0004 * n * (1 + context / 1000)

    m = StepCostModel()
    for n, context in [(8, 268), (94, 268), (6, 413), (7, 413), (8, 413), (1, 128),
                       (8, 128), (240, 128)]:
        m.observe(n, cost(n, context), context=context)
    assert m.priced(4, context=268) and not m.measured(4, context=268)
    shrunk = np.interp(4, [1, 8], [cost(1, 128), cost(8, 128)]) / cost(8, 128)
    assert m.estimate(4, 268) == pytest.approx(cost(8, 268) * shrunk)
    # bucket 9 (smallest 6) too takes bucket 7's shape, which reaches down to 1
    assert m.priced(1, context=413) and m.priced(5, context=413)
    # prefill-only steps (bucket 0), whose shape prices no decode bucket, lend one a shape
    # only where no decode bucket can: measuring further down does not make them the lender
    m = StepCostModel()
    for n, context in [(8, 268), (94, 268), (2, 128), (8, 128), (240, 128), (1, 0), (300, 0)]:
        m.observe(n, cost(n, context), context=context)
    assert m.priced(4, context=268)
    shrunk = np.interp(4, [2, 8], [cost(2, 128), cost(8, 128)]) / cost(8, 128)
    assert m.estimate(4, 268) == pytest.approx(cost(8, 268) * shrunk)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 33, 41, 46, 64]),
                          st.sampled_from([0, 100, 300, 700, 1500])), min_size=1, max_size=12))
def test_a_plain_step_never_costs_less_than_a_smaller_one(steps) -> None:
    """Whatever was measured where, plain estimates grow with the size in every context:
    borrowing another bucket's value or shape size by size (the first bucket that measured
    this size) made a 3-token step cheaper than a 2-token one."""
    m = StepCostModel()
    for n, context in steps:
        m.observe(n, 0.02 + 0.0005 * n * (1 + context / 1000), context=context)
    for context in (0, 100, 300, 700, 1500, 3000):
        estimates = [m.estimate(n, context) for n in range(1, 70)]
        assert all(b >= a - 1e-12 for a, b in zip(estimates, estimates[1:]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2, 4, 9, 17, 33, 64]),
                          st.sampled_from([0, 100, 700]), st.sampled_from([0, 0, 4, 8, 16]),
                          st.booleans(), st.floats(0.5, 2.0)), min_size=1, max_size=10))
def test_prices_kept_between_observations_equal_prices_computed_afresh(steps) -> None:
    """Derived curves, slopes and bucket orders are kept per table until its next
    observation: a model asked after every step prices exactly as a fresh model fed the same
    steps and asked once."""
    asked = StepCostModel()
    sizes = [(n, d, tree) for n in (1, 3, 8, 20, 40, 90) for d in (0, 4, 12)
             for tree in (True, False) if d < n]

    def prices(m):
        return [(m.estimate(n, c, d, tree), m.priced(n, c))
                for n, d, tree in sizes for c in (0, 100, 300, 700, 3000)]

    for i, (n, context, drafts, tree, scale) in enumerate(steps):
        seconds = scale * (0.02 + 0.0005 * n * (1 + context / 1000))
        asked.observe(n + drafts, seconds, context=context, drafts=drafts, tree=tree)
        fresh = StepCostModel()
        for n2, c2, d2, t2, s2 in steps[:i + 1]:
            fresh.observe(n2 + d2, s2 * (0.02 + 0.0005 * n2 * (1 + c2 / 1000)), context=c2,
                          drafts=d2, tree=t2)
        assert prices(asked) == prices(fresh)


def test_larger_batches_get_smaller_budgets():
    costs = {n: 0.05 + 0.004 * n for n in range(1, 300)}
    ctl = _controller_after(costs, accept=0.8)
    alone = ctl.choose([chain_tree(16, 0.8)], fixed_tokens=0)
    crowd = ctl.choose([chain_tree(16, 0.8)] * 16, fixed_tokens=0)
    assert crowd < alone


def test_simulated_machine_is_never_slower_than_plain_decoding():
    """Closed loop on a synthetic machine with a CPU-like cost cliff and mediocre drafts:
    the controller's measured throughput must not fall below plain decoding's."""
    rng = np.random.default_rng(0)

    def step_cost(n):
        return 0.10 if n <= 2 else 0.10 + 0.012 * n

    accept = 0.45
    ctl = BudgetController(16, DISCOUNTS)
    tree = chain_tree(16, accept)
    tokens = seconds = 0.0
    for _ in range(600):
        b = ctl.choose([tree], fixed_tokens=0)
        sec = step_cost(1 + b) * rng.uniform(0.95, 1.05)
        accepted = 0
        while accepted < b and rng.random() < accept:
            accepted += 1
        ctl.observe_step(1 + b, sec, drafts=b)
        ctl.observe_tree(tree.parents[:1 + b], tree.scores[:1 + b], accepted)
        tokens += 1 + accepted
        seconds += sec
    assert tokens / seconds >= 0.97 / step_cost(1)


def test_one_slow_plain_step_does_not_make_drafting_look_free():
    """Costs rise steeply with size and drafts are poor, but the first plain-decoding step
    was slow (a burst of arrivals): plain decoding must still win once sizes are measured."""
    ctl = _controller_after({1: 0.50}, accept=0.2)
    tree = [chain_tree(16, 0.2)]
    picks = []
    for _ in range(80):
        b = ctl.choose(tree, fixed_tokens=0)
        picks.append(b)
        ctl.observe_step(1 + b, 0.10 + 0.03 * b)
    assert picks[-16:].count(0) >= 12, picks


def test_drafting_must_beat_plain_decoding_by_the_margin():
    from vllm_recap.core.budget import DRAFT_MARGIN

    ctl = _controller_after({1: 0.100, 2: 0.100}, accept=0.9)
    tree = chain_tree(1, 0.9)
    gain = float(ctl.expected_gains(tree)[1])
    # a step with one draft costs just enough that its expected rate is within the margin
    ctl.cost = type(ctl.cost)()
    ctl.observe_step(1, 0.100)
    ctl.observe_step(2, 0.100 * (1 + gain) / (DRAFT_MARGIN - 0.01))
    assert ctl.choose([tree], fixed_tokens=0) == 0
    ctl.cost = type(ctl.cost)()
    ctl.observe_step(1, 0.100)
    ctl.observe_step(2, 0.100 * (1 + gain) / (DRAFT_MARGIN + 0.01))
    assert ctl.choose([tree], fixed_tokens=0) == 1


def test_the_margin_grows_with_the_batch() -> None:
    """The same expected gain, 10% above plain decoding, drafts for one request and not for
    16 (under load estimates are mostly off by more than the gain, and a batch's run ends
    with its slowest request)."""
    from vllm_recap.core.budget import draft_margin

    assert draft_margin(1) == pytest.approx(1.03) and draft_margin(4) == pytest.approx(1.06)
    assert draft_margin(16) == draft_margin(64) == pytest.approx(1.18)
    for batch, drafts in ((1, True), (16, False)):
        ctl = _controller_after({1: 0.100}, accept=0.9)
        tree = chain_tree(1, 0.9)
        gain = float(ctl.expected_gains(tree)[1])
        ctl.cost = type(ctl.cost)()
        ctl.observe_step(batch, 0.100)
        # one draft for every request: 10% more tokens per second than plain, as estimated
        ctl.observe_step(2 * batch, 0.100 * (1 + gain) / 1.10)
        assert (ctl.choose([tree] * batch, fixed_tokens=0) > 0) is drafts, batch


def test_sampled_and_greedy_acceptance_are_calibrated_apart() -> None:
    """A sampled request accepts less for the same builder scores than a greedy one: its
    trees must be sized by its own calibration, not the greedy traffic's."""
    ctl = BudgetController(16, RecapConfig().depth_discounts)
    tree = DraftTree(np.array([0, 1, 2, 3]), np.array([-1, 0, 1, 2]), np.array([1.0, .5, .3, .2]))
    for _ in range(200):
        ctl.observe_tree(tree.parents, tree.scores, 3, tree.depths, kind="greedy")
        ctl.observe_tree(tree.parents, tree.scores, 0, tree.depths, kind="sampled")
    greedy, sampled = ctl.expected_gains(tree, "greedy"), ctl.expected_gains(tree, "sampled")
    assert greedy[-1] > 2.5 and sampled[-1] < 0.5


def test_cost_is_learned_per_context_length() -> None:
    """A tree that pays at a short context must not be chosen where long contexts made the
    same token count dear (the cost model used to be keyed by token count only)."""
    ctl = BudgetController(16, RecapConfig().depth_discounts)
    tree = DraftTree(np.arange(17), np.arange(-1, 16), np.r_[1.0, np.full(16, 0.9)])
    for _ in range(300):
        ctl.observe_tree(tree.parents, tree.scores, 16, tree.depths)  # everything accepted
    for n in (1, 17):  # short context: 17 tokens cost 1.2x one; long: 30x
        for _ in range(3):
            ctl.observe_step(n, 0.010 * (1.2 if n == 17 else 1.0), context=100)
            ctl.observe_step(n, 0.010 * (30.0 if n == 17 else 1.0), context=1500)
    assert ctl.choose([tree], 0, context=100) == 16
    assert ctl.choose([tree], 0, context=1500) == 0
    # an unmeasured context: plain decoding is measured there first
    assert ctl.choose([tree], 0, context=6000) == 0
    assert not ctl.cost.measured(1, 6000) and ctl.cost.measured(17, 1500)


def test_a_new_context_bucket_prices_larger_sizes_by_growth_measured_elsewhere() -> None:
    """Under load the mean context moves from bucket to bucket; a bucket where only the plain
    step is measured used to price every larger size like the plain step, so each new bucket
    started by verifying the largest trees (c=4: 0.85x of no speculation)."""
    m = StepCostModel()
    m.observe(4, 0.030, context=300)
    m.observe(40, 0.075, context=300)
    m.observe(4, 0.032, context=700)  # the next bucket: only the plain size so far
    assert m.estimate(40, context=700) == pytest.approx(0.032 * 0.075 / 0.030)
    assert m.estimate(22, context=700) == pytest.approx(0.032 * np.interp(
        StepCostModel.bucket(22), [4, StepCostModel.bucket(40)], [0.030, 0.075]) / 0.030)
    assert m.estimate(4, context=700) == pytest.approx(0.032)  # own measurements first
    lone = StepCostModel()
    lone.observe(4, 0.030, context=300)  # nothing measured beyond: still optimistic
    assert lone.estimate(40, context=300) == pytest.approx(0.030)


def test_poor_trees_in_a_new_context_bucket_are_not_explored_at_full_size() -> None:
    ctl = BudgetController(16, DISCOUNTS)
    tree = chain_tree(16, 0.3)
    for _ in range(40):
        ctl.calibration().observe(np.arange(17), tree.scores, 1)
    for n, sec in ((4, 0.030), (8, 0.033), (20, 0.045), (36, 0.062), (68, 0.11)):
        ctl.observe_step(n, sec, context=300)
    ctl.observe_step(4, 0.032, context=700)
    assert ctl.choose([tree] * 4, fixed_tokens=0, context=700) <= 1


def test_drafted_steps_are_not_priced_by_prefill_steps_of_the_same_size() -> None:
    """Under load a step of 52 tokens is either a prefill chunk with 4 decodes (cheap: 35 ms)
    or 4 decodes with 48 draft tokens (150 ms here: tree attention, logits rows, acceptance).
    Pricing drafts by token count alone took their cost from the prefill chunks around them,
    and trees were chosen at concurrency 4 where they lost to plain decoding."""
    ctl = BudgetController(16, DISCOUNTS)
    tree = chain_tree(16, 0.6)
    for i in range(300):  # the first draft is accepted 30% of the time, deeper ones never
        ctl.observe_tree(tree.parents[:13], tree.scores[:13], int(i % 10 < 3), tree.depths[:13])
    ctl.observe_step(4, 0.025)                 # 4 decodes
    ctl.observe_step(52, 0.150, drafts=48)     # 4 decodes + 4 x 12 drafts
    for _ in range(3):                         # prefill chunks of several sizes + 4 decodes
        for n, seconds in ((36, 0.030), (52, 0.035), (68, 0.040)):
            ctl.observe_step(n, seconds)
            ctl.observe_step(4, 0.025)
    assert ctl.cost.estimate(52, drafts=48) == pytest.approx(0.150)
    assert ctl.cost.estimate(52) == pytest.approx(0.035)
    # one draft each: 4 x 1.3 tokens for 25 + 125 / 12 ms loses to 4 tokens in 25 ms
    assert ctl.choose([tree] * 4, fixed_tokens=0) == 0
    # the extra cost of drafts is interpolated from zero and grows in proportion beyond
    assert ctl.cost.estimate(28, drafts=24) == pytest.approx(0.025 + 0.125 / 2, rel=0.05)
    assert ctl.cost.estimate(100, drafts=96) == pytest.approx(0.025 + 0.125 * 2, rel=0.1)


def test_calibration_follows_the_score_not_only_the_depth() -> None:
    """High-scoring first drafts are accepted 20% of the time, low-scoring ones 15%: one
    factor per depth (mass-weighted) prices a high-scoring draft at 34%, and the budget then
    verifies the trees it overrates. The per-score-range factor gets both right."""
    ctl = BudgetController(16, DISCOUNTS)
    rng = np.random.default_rng(0)
    high = DraftTree(np.arange(2), np.array([-1, 0]), np.array([1.0, 0.5]))
    low = DraftTree(np.arange(2), np.array([-1, 0]), np.array([1.0, 0.02]))
    for _ in range(4000):
        for tree, rate in ((high, 0.20), (low, 0.15)):
            ctl.observe_tree(tree.parents, tree.scores, int(rng.random() < rate), tree.depths)
    assert float(ctl.expected_gains(high)[1]) == pytest.approx(0.20, abs=0.04)
    assert float(ctl.expected_gains(low)[1]) == pytest.approx(0.15, abs=0.04)


def test_calibration_counts_the_accepted_node_not_the_best_chain() -> None:
    """A tree whose off-chain sibling (low score) is the one accepted: the acceptance is
    booked to that node's score range, not to the best chain's first node."""
    ctl = BudgetController(16, DISCOUNTS)
    tree = DraftTree(np.arange(3), np.array([-1, 0, 0]), np.array([1.0, 0.6, 0.01]))
    for _ in range(2000):
        ctl.observe_tree(tree.parents, tree.scores, np.array([2]), tree.depths)
    p = ctl.calibration().node_probabilities(tree.depths, tree.parents, tree.scores)
    assert p[1] < 0.05 and p[2] > 0.9


def test_plain_decoding_is_priced_as_idling_without_the_drafters_work() -> None:
    """A step that drafts nothing still pays the drafter's rows and proposals (4 ms of 29 ms
    at concurrency 4), but choosing not to draft means idling, which skips them: plain
    decoding costs 25 ms. Drafting one node per request for +0.15 tokens each must lose."""
    ctl = BudgetController(16, DISCOUNTS)
    tree = chain_tree(16, 0.6)
    for i in range(300):  # the first draft is accepted 15% of the time
        ctl.observe_tree(tree.parents[:2], tree.scores[:2], int(i % 20 < 3), tree.depths[:2])
    for _ in range(4):
        ctl.observe_step(4, 0.029, work=0.004)       # 4 decodes, drafter busy, no drafts
        ctl.observe_step(8, 0.030, drafts=4)         # 4 decodes + 1 draft each
    ctl.observe_step(4, 0.029, work=0.004)  # off the every-8th-step re-measuring of sizes
    assert ctl.cost.estimate(4) == pytest.approx(0.025)
    # against 29 ms one draft each (4.6 tokens in 30 ms) would win; against 25 ms it loses,
    # and so does one draft for one request (4.15 tokens in 26.25 ms)
    assert ctl.choose([tree] * 4, fixed_tokens=0) == 0


def test_a_level_that_disappoints_its_estimates_is_chosen_less() -> None:
    """The winner's curse: the level the controller picks is the one whose estimate is most
    flattering. Levels whose verified steps ran dearer and accepted fewer drafts than
    estimated get their estimates corrected by what they actually did."""
    costs = {n: 0.025 + 0.0011 * max(0, n - 4) for n in range(1, 80)}
    ctl = _controller_after(costs, accept=0.95)
    trees = [chain_tree(16, 0.95)] * 4
    first = ctl.choose(trees, fixed_tokens=0)
    level = ctl.last_decision.level  # the batch's draft nodes
    assert first >= 8 and level == sum(ctl.last_counts) and max(ctl.last_counts) == first
    for _ in range(20):  # that level's steps: 1.5x dearer, half the accepted drafts
        d = ctl.last_decision
        if d is None or d.level != level:
            break
        ctl.observe_outcome(d, d.seconds * 1.5, int(d.gain / 2))
        ctl.choose(trees, fixed_tokens=0)
    assert ctl.choose(trees, fixed_tokens=0) < first
    cost_ratio, gain_ratio = ctl.outcomes.ratios(level)
    assert cost_ratio > 1.05 and gain_ratio < 0.95
    # never chosen: its shape's pooled correction, weaker than the level's own
    never_cost, never_gain = ctl.outcomes.ratios(1)
    assert 1.0 < never_cost < cost_ratio and gain_ratio < never_gain < 1.0
    assert ctl.outcomes.ratios(1, chain=True) == (1.0, 1.0)  # another shape: none


def test_a_bias_shared_by_every_level_stops_drafting_that_does_not_pay() -> None:
    """Under load every level ran dearer than estimated (concurrency 16: +23% over ~15
    levels, each chosen a few times). A level chosen for the first time carries what the
    others measured, so once the drafted steps have shown that drafting does not pay, the
    controller stops drafting instead of trying each level in turn."""
    costs = {n: 0.025 + 0.0011 * max(0, n - 4) for n in range(1, 80)}
    ctl = _controller_after(costs, accept=0.7)
    trees = [chain_tree(16, 0.7)] * 4
    drafted = []
    for _ in range(40):
        ctl.choose(trees, fixed_tokens=0)
        d = ctl.last_decision
        if d is None:
            break
        drafted.append(d.level)
        ctl.observe_outcome(d, d.seconds * 1.6, int(d.gain / 2))
    assert ctl.last_decision is None  # drafting stopped
    # without the pooled correction: 24 drafted steps over 8 levels before it stops
    assert len(drafted) <= 8, drafted


def _chain_with_siblings(sibling_share: float, p_chain: float = 0.8) -> DraftTree:
    """A best chain of 8 (each node ``p_chain`` likely given its parent) plus a sibling of
    each of its first 4 nodes, taken with probability ``sibling_share`` when the chain node is
    not, laid out best first."""
    tokens, parents, scores = [0], [-1], [1.0]
    chain_node, chain_score = 0, 1.0
    for i in range(8):
        if i < 4:
            tokens.append(100 + i)
            parents.append(chain_node)
            scores.append(chain_score * (1 - p_chain) * sibling_share)
        tokens.append(1 + i)
        parents.append(chain_node)
        chain_score *= p_chain
        scores.append(chain_score)
        chain_node = len(tokens) - 1
    return DraftTree(np.array(tokens), np.array(parents), np.array(scores)).best_first()


def _walk(tree: DraftTree, sibling_share: float, rng, p_chain: float = 0.8) -> np.ndarray:
    """Indices of the nodes the target accepts (root excluded), as :func:`_chain_with_siblings`
    describes the target."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents.tolist()[1:], 1):
        children.setdefault(p, []).append(i)
    accepted, v = [], 0
    while True:
        kids = children.get(v, [])
        chain_kid = [k for k in kids if tree.tokens[k] < 100]
        sibling = [k for k in kids if tree.tokens[k] >= 100]
        u = rng.random()
        if u < p_chain:
            nxt = chain_kid[:1]
        elif u < p_chain + (1 - p_chain) * sibling_share:
            nxt = sibling[:1]
        else:
            nxt = []
        if not nxt:
            return np.array(accepted, np.int64)
        v = nxt[0]
        accepted.append(v)
        if tree.tokens[v] >= 100:  # a sibling has no children: the target goes on unseen
            return np.array(accepted, np.int64)


@pytest.mark.parametrize("tree_overhead, sibling_share, p_chain, want_chains", [
    # a tree pass costs 30% of a plain pass more: its siblings (0.1 likely) don't pay
    (0.03, 0.5, 0.8, True),
    # trees cost what chains of as many tokens do, and a sibling is almost as likely as its
    # chain node: a tree of 8 expects 1.8 accepted drafts, a chain of 8 1.0. (With a 0.8
    # chain and 0.2 siblings the tree of 8 is the chain of 7 plus one sibling, worth 1% more
    # than the chain of 8: which shape won was a coin flip, chains on 4 of 8 seeds.)
    (0.0, 0.9, 0.5, False),
])
@pytest.mark.parametrize("seed", range(4))
def test_the_budget_sends_chains_where_trees_do_not_pay(tree_overhead, sibling_share, p_chain,
                                                         want_chains, seed):
    """Closed loop on a synthetic machine where a step that verifies a tree pays a fixed
    overhead over a chain step of as many tokens (CPU tree attention and tree acceptance):
    offered both shapes, the controller learns both costs and sends the cheaper shape."""
    rng = np.random.default_rng(seed)
    full = _chain_with_siblings(sibling_share, p_chain)
    chain = full.first_path()
    assert chain.is_chain() and chain.num_drafts == 8 and not full.is_chain()

    def step_cost(drafts: int, tree: bool) -> float:
        return 0.10 + 0.004 * drafts + (tree_overhead if tree else 0.0)

    ctl = BudgetController(16, DISCOUNTS)
    shapes = []
    for step in range(800):
        b = ctl.choose([full], fixed_tokens=0, chains=True)
        decision = ctl.last_decision
        laid = (chain if ctl.last_chain else full).truncate(1 + b).depth_first()
        is_tree = not laid.is_chain()
        accepted = _walk(laid, sibling_share, rng, p_chain) if b else np.zeros(0, np.int64)
        sec = step_cost(laid.num_drafts, is_tree) * rng.uniform(0.97, 1.03)
        ctl.observe_step(1 + laid.num_drafts, sec, drafts=laid.num_drafts, tree=is_tree)
        if b:
            ctl.observe_tree(laid.parents, laid.scores, accepted, laid.depths)
            ctl.observe_outcome(decision, sec, len(accepted))
        if step >= 400 and b:
            shapes.append(not is_tree)
    assert len(shapes) > 300  # drafting pays on both machines
    chain_share = np.mean(shapes)
    assert chain_share > 0.8 if want_chains else chain_share < 0.2


def test_first_path_follows_the_first_children():
    tree = DraftTree(np.arange(6), np.array([-1, 0, 0, 1, 2, 3]), np.array([1, .5, .4, .3, .35, .1]))
    path = tree.first_path()
    assert path.tokens.tolist() == [0, 1, 3, 5] and path.is_chain() and path.chain_len == 3
    assert tree.leading_chain() == 1 and path.leading_chain() == 3
    rng = np.random.default_rng(1)
    for _ in range(100):  # the first path depth-first lays out, on random best-first trees
        n = int(rng.integers(2, 20))
        parents = np.r_[-1, [rng.integers(0, i) for i in range(1, n)]]
        tree = DraftTree(np.arange(n), parents, rng.random(n)).best_first()
        laid = tree.depth_first()
        want = laid.truncate(1 + laid.leading_chain())
        assert tree.first_path().tokens.tolist() == want.tokens.tolist()
        assert tree.first_path().depths.tolist() == list(range(want.num_nodes))


def test_a_batch_drafts_for_its_confident_requests_only():
    """Under load each draft node costs a step's share; the nodes go to the requests whose
    nodes are likeliest accepted, not the same count to every request."""
    costs = {n: 0.025 + 0.002 * max(0, n - 4) for n in range(1, 80)}
    ctl = _controller_after(costs, accept=0.95)
    confident, poor = chain_tree(16, 0.95), chain_tree(16, 0.05)
    b = ctl.choose([poor, confident, poor, poor], fixed_tokens=0)
    assert b > 0 and ctl.last_counts[1] == b
    assert ctl.last_counts[0] == ctl.last_counts[2] == ctl.last_counts[3] == 0
    assert ctl.last_decision.level == b


def test_a_draining_run_is_shortened_only_through_its_longest_requests() -> None:
    """While a batch drains the engine runs until its longest request is done, and a step's
    cost hardly depends on how many requests it runs (Intel Xeon, bf16: 31 ms for nine, 26
    for one), so drafts pay only by taking steps off the longest request. Priced by
    committed tokens, nine requests tied for the longest drafted although one of them had
    nothing to offer: the run waited for that one, and fell to 0.87-0.94x of plain
    decoding at concurrency 16."""
    costs = {n: 0.030 + 0.0005 * n for n in range(1, 200)}
    ctl = _controller_after(costs, accept=0.9)
    good, poor = chain_tree(16, 0.9), chain_tree(16, 0.05)
    tied = [good] * 8 + [poor]
    assert ctl.choose(tied, fixed_tokens=0) > 0  # by committed tokens the eight draft
    assert ctl.choose(tied, fixed_tokens=0, drain=Drain(np.inf, 9)) == 0
    # all nine draft well: every one gets nodes (the run is as long as the least helped)
    assert ctl.choose([good] * 9, fixed_tokens=0, drain=Drain(np.inf, 9)) > 0
    assert min(ctl.last_counts) > 0
    # one request is the longest: its drafts pay (the other eight run a token each)
    alone = ctl.choose([good], fixed_tokens=8, drain=Drain(np.inf, 9))
    assert alone > 1
    # ... but no more than its lead over the next-longest comes off the run
    assert ctl.choose([good], fixed_tokens=8, drain=Drain(1.0, 9)) < alone
    assert ctl.choose([poor], fixed_tokens=8, drain=Drain(np.inf, 9)) == 0


def test_drafts_measured_at_batch_1_are_not_priced_below_plain_tokens_under_load() -> None:
    """The extra cost of drafts is keyed by draft count, not batch, and the sizes it holds
    were measured at batch 1, where a few drafts ride along almost free. At concurrency 16
    (bf16 SmolLM2, the tables below are the engine's own) it priced 50 chain drafts at
    24.2 ms for the whole step -- 2 ms over the plain 16-token step -- and the step cost
    43.6 ms: a drafted step never costs less than a plain step of as many tokens."""
    m = StepCostModel()
    m.observe(1, 0.01466, context=64)
    m.observe(1, 0.01593, context=104)
    m.observe(16, 0.02222, context=104)  # 16 decodes
    m.observe(6, 0.01466 + 0.00088, context=64, drafts=5, tree=False)  # batch 1, warm-up
    m.observe(3, 0.01593 + 0.00164, context=104, drafts=2, tree=False)
    m.observe(5, 0.01593 + 0.00179, context=104, drafts=4, tree=False)
    plain_66 = m.estimate(66, context=104)
    assert plain_66 > 0.040  # the plain steps' slope (0.42 ms a token) carried on
    assert m.estimate(66, context=104, drafts=50, tree=False) >= plain_66
    # below the plain curve's reach the measured extra cost still decides
    assert m.estimate(5, context=104, drafts=4, tree=False) == pytest.approx(0.01593 + 0.00179)
    # and the controller declines what it chose before: 16 modest chains
    ctl = BudgetController(16, DISCOUNTS)
    ctl.cost = m
    tree = chain_tree(16, 0.5)
    for _ in range(60):
        ctl.calibration().observe(np.arange(17), tree.scores, 1)
    assert ctl.choose([tree] * 16, fixed_tokens=0, context=104, chains=True) <= 1


def test_growth_borrowed_from_another_bucket_carries_on_beyond_its_sizes() -> None:
    """A bucket that lends its growth to a new one used to stop growing at its own largest
    size (its curve is flat there), so every size beyond both priced like that size."""
    m = StepCostModel()
    m.observe(4, 0.030, context=300)
    m.observe(40, 0.075, context=300)
    m.observe(4, 0.032, context=700)  # the next bucket: only the plain size so far
    assert m.estimate(80, context=700) > 1.5 * m.estimate(40, context=700)
    extra = StepCostModel()
    extra.observe(1, 0.010, context=300)
    extra.observe(1, 0.010, context=700)
    extra.observe(5, 0.012, context=300, drafts=4)  # 2 ms for 4 drafts
    extra.observe(3, 0.011, context=700, drafts=2)  # 1 ms for 2 drafts
    # 32 drafts at 700: 1 ms + the growth at 300 from 2 to 32 drafts, carried on in
    # proportion beyond its 4: 1 + (2 * 32 / 4 - 1) = 16 ms over the plain step
    assert extra.estimate(33, context=700, drafts=32) == pytest.approx(0.010 + 0.016)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), max_size=40), st.integers(0, 45))
def test_one_requests_nodes_merge_as_in_a_batch(probs, straight) -> None:
    """At batch 1 the merge takes a shortcut (a request's own order, no sort): it adds the
    nodes in the order, with the expected gains (the same float sums) and tree flags, of the
    general merge -- here the same request beside one with nothing to offer."""
    from vllm_recap.core.budget import _merge

    assert _merge([probs], [straight]) == _merge([probs, []], [straight, 0])
