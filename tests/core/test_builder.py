"""Tree building through the Drafter: golden best-first trees, suffix merge, Token Recycling,
FIXED template, and invariants of every proposal on random memories."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllm_recap.core import (
    Drafter,
    DraftTree,
    FusionMode,
    Policy,
    RecapConfig,
    SharedIndexMode,
    SuffixMode,
    TreeShape,
    tree_depths,
)
from vllm_recap.core._kernels import SUF_WIDTH
from vllm_recap.core.tree import SOURCE_MEMORY
from vllm_recap.core.config import MAX_DEPTH, discount_table
from vllm_recap.core.recycling import LEVEL_SIZES, TEMPLATE_PARENTS, TEMPLATE_RANKS

pytestmark = pytest.mark.unit


def start_with_unigram(d: Drafter, rid: str, table: dict[int, tuple[list[int], list[float]]],
                       history: list[int]) -> None:
    """Starts `rid` with U[token] = row for each table entry, then the given history."""
    tokens = list(table)
    ids = np.array([table[t][0] for t in tokens])
    probs = np.array([table[t][1] for t in tokens])
    d.start(rid, tokens + history, prompt_rows=(ids, probs, np.arange(len(tokens))))


def u_only(**kw: object) -> Drafter:
    blocked = kw.pop("blocked", ())
    # The paper's scores (d(depth) * q): calibrated_scores off.
    cfg = dict(top_k=2, depth_discounts=(0.5,), use_context_memories=False, suffix_len=0,
               calibrated_scores=False)
    cfg.update(kw)
    return Drafter(RecapConfig(**cfg), 20, blocked_token_ids=blocked)


TABLE = {
    1: ([2, 3], [0.6, 0.4]),
    2: ([4, 5], [0.9, 0.1]),
    3: ([6, 7], [0.5, 0.5]),
    4: ([8, 9], [0.8, 0.2]),
}


def check(tree: DraftTree, tokens: list[int], parents: list[int], scores: list[float],
          chain_len: int) -> None:
    assert tree.tokens.tolist() == tokens
    assert tree.parents.tolist() == parents
    np.testing.assert_allclose(tree.scores, scores, rtol=1e-6)
    assert tree.chain_len == chain_len


def test_golden_best_first() -> None:
    # Root 1, d = 0.5 everywhere. Candidates: 2 (.5*.6 = .30), 3 (.20). Pop 2 -> push
    # 4 (.30*.5*.9 = .135), 5 (.015). Pop 3 -> push 6, 7 (.05 each). Pop 4 -> push 8 (.054),
    # 9 (.0135). Pop 8. Budget 4 reached. Pop order: 2, 3, 4, 8; best chain 2 -> 4 -> 8 first.
    d = u_only(node_budget=4)
    start_with_unigram(d, "a", TABLE, [1])
    check(d.propose("a"), [1, 2, 4, 8, 3], [-1, 0, 1, 2, 0], [1, .3, .135, .054, .2], 3)
    # One more node: the tie 6/7 (.05) goes to the earlier-pushed 6.
    check(d.propose("a", node_budget=5), [1, 2, 4, 8, 3, 6], [-1, 0, 1, 2, 0, 4],
          [1, .3, .135, .054, .2, .05], 3)


def test_golden_max_depth() -> None:
    # Depth 2: node 4 (depth 2) is not expanded, so 6 and 7 come next.
    d = u_only(node_budget=5, max_depth=2)
    start_with_unigram(d, "a", TABLE, [1])
    check(d.propose("a"), [1, 2, 4, 3, 6, 7], [-1, 0, 1, 0, 3, 3],
          [1, .3, .135, .2, .05, .05], 2)


def test_golden_blocked_token() -> None:
    # 4 blocked: under 2 only 5 (.015) remains; 6 and 7 (no rows) win the budget.
    d = u_only(node_budget=4, blocked=[4])
    start_with_unigram(d, "a", TABLE, [1])
    check(d.propose("a"), [1, 2, 3, 6, 7], [-1, 0, 0, 2, 2], [1, .3, .2, .05, .05], 1)


def test_golden_no_repeated_edge() -> None:
    # U: 1 -> (2, 3), 2 -> (1, 3). Path 1 -> 2 -> 1 may not continue with edge (1, 2) again.
    d = u_only(node_budget=20)
    start_with_unigram(d, "a", {1: ([2, 3], [0.9, 0.1]), 2: ([1, 3], [0.9, 0.1])}, [1])
    t = d.propose("a")
    assert t.best_path().tolist() == [2, 1, 3]
    assert sorted(t.draft_tokens.tolist()) == [1, 2, 3, 3, 3]


EARLIEST = {"suffix_mode": "earliest", "suffix_len": 4}


def test_suffix_path_is_merged_on_top_of_the_budget() -> None:
    # History 1 5 9 1: "1" occurred before, followed by 5 9 1. U[1] = (2: .9, 5: .1).
    table = {1: ([2, 5], [0.9, 0.1])}
    d = Drafter(RecapConfig(top_k=2, node_budget=1, use_context_memories=False, **EARLIEST), 20)
    d.start("a", [1, 5, 9, 1], prompt_rows=(np.array([[2, 5]]), np.array([[0.9, 0.1]]), [0]))
    t = d.propose("a")
    # Budget node: 2 (.68 * .9 = .612). Suffix: 5 scores .68 * max(q = .1, prior .3) = .204,
    # 9 scores .204 * .63 * .3, 1 scores that * .5 * .3. The best chain stays on 2.
    s5 = 0.68 * 0.3
    s9 = s5 * .63 * .3
    check(t, [1, 2, 5, 9, 1], [-1, 0, 0, 2, 3], [1, .612, s5, s9, s9 * .5 * .3], 1)
    assert t.best_path().tolist() == [2]
    # With a suffix prior of 1 the suffix branch scores higher and becomes the best chain.
    d2 = Drafter(RecapConfig(top_k=2, node_budget=1, use_context_memories=False,
                             suffix_prior=1.0, **EARLIEST), 20)
    start_with_unigram(d2, "a", table, [5, 9, 1])
    t2 = d2.propose("a")
    assert t2.tokens.tolist() == [1, 5, 9, 1, 2] and t2.best_path().tolist() == [5, 9, 1]
    assert t2.parents.tolist() == [-1, 0, 1, 2, 0]


def test_suffix_shares_existing_nodes() -> None:
    table = {1: ([5, 2], [0.9, 0.1])}
    d = Drafter(RecapConfig(top_k=2, node_budget=1, use_context_memories=False, **EARLIEST), 20)
    start_with_unigram(d, "a", table, [5, 9, 1])
    t = d.propose("a")
    assert t.tokens.tolist() == [1, 5, 9, 1] and t.is_chain()  # 5 is shared, not duplicated


def test_suffix_stops_at_a_repeated_edge_and_at_blocked_tokens() -> None:
    # "5" occurred at 0, followed by 1 2 1 2: the path 5 1 2 1 would next repeat edge (1, 2).
    d = Drafter(RecapConfig(top_k=2, node_budget=1, use_context_memories=False, **EARLIEST), 20)
    d.start("a", [5, 1, 2, 1, 2, 1, 2, 9, 5])
    assert d.propose("a").tokens.tolist() == [5, 1, 2, 1]
    d2 = Drafter(RecapConfig(top_k=2, node_budget=1, use_context_memories=False, **EARLIEST), 20,
                 blocked_token_ids=[2])
    d2.start("a", [5, 1, 2, 1, 2, 1, 2, 9, 5])
    assert d2.propose("a").tokens.tolist() == [5, 1]
    d3 = Drafter(RecapConfig(top_k=2, node_budget=1, suffix_len=0), 20)
    d3.start("a", [5, 1, 2, 1, 2, 1, 2, 9, 5])
    assert d3.propose("a").num_drafts == 0


def test_deepest_level_scores_with_the_whole_discount_table() -> None:
    # U: t -> t + 1 with certainty, so the tree is one chain down to MAX_DEPTH whose scores
    # are the running products of the discount table.
    cfg = RecapConfig(top_k=1, node_budget=100, max_depth=MAX_DEPTH, suffix_len=0,
                      use_context_memories=False, calibrated_scores=False)
    d = Drafter(cfg, 100)
    start_with_unigram(d, "a", {t: ([t + 1], [1.0]) for t in range(99)}, [0])
    t = d.propose("a")
    assert t.num_drafts == MAX_DEPTH and t.is_chain() and t.chain_len == MAX_DEPTH
    assert t.depths.tolist() == list(range(MAX_DEPTH + 1))
    np.testing.assert_allclose(t.scores, np.cumprod(discount_table(cfg.depth_discounts)),
                               rtol=1e-12)


# ---------------------------------------------------------------- Token Recycling


def test_template_level_sizes_and_layout() -> None:
    depths = tree_depths(TEMPLATE_PARENTS)
    assert LEVEL_SIZES == (8, 21, 25, 15, 8, 3) and TEMPLATE_PARENTS.shape == (81,)
    assert np.bincount(depths).tolist() == [1, 8, 21, 25, 15, 8, 3]
    # Rank-0 chain first, then level by level.
    assert TEMPLATE_PARENTS[:7].tolist() == [-1, 0, 1, 2, 3, 4, 5]
    assert TEMPLATE_RANKS[:7].tolist() == [-1, 0, 0, 0, 0, 0, 0]
    assert np.all(np.diff(depths[7:]) >= 0)
    # Golden head of the template: the root's ranks 1..7, then rank-0 child's ranks 1..7.
    assert TEMPLATE_PARENTS[7:21].tolist() == [0] * 7 + [1] * 7
    assert TEMPLATE_RANKS[7:21].tolist() == list(range(1, 8)) * 2
    pairs = set(zip(TEMPLATE_PARENTS[1:].tolist(), TEMPLATE_RANKS[1:].tolist(), strict=True))
    assert len(pairs) == 80  # no duplicate (parent, rank)


def _full_unigram(vocab: int, seed: int = 0) -> dict[int, tuple[list[int], list[float]]]:
    rng = np.random.default_rng(seed)
    p = 0.5 ** np.arange(8)
    return {t: (rng.permutation(vocab)[:8].tolist(), (p / p.sum()).tolist()) for t in range(vocab)}


def test_token_recycling_fills_the_template_from_unigram_rows() -> None:
    vocab = 64
    table = _full_unigram(vocab)
    d = Drafter(RecapConfig(policy=Policy.TOKEN_RECYCLING, node_budget=80), vocab)
    start_with_unigram(d, "a", table, [7])
    t = d.propose("a")
    assert t.num_drafts == 80 and np.bincount(t.depths).tolist() == [1, 8, 21, 25, 15, 8, 3]
    for i in range(1, t.num_nodes):
        assert t.tokens[i] in table[int(t.tokens[t.parents[i]])][0]
    assert sorted(t.tokens[t.parents == 0].tolist()) == sorted(table[7][0])
    chain = [7]
    for _ in range(6):
        chain.append(table[chain[-1]][0][0])
    assert t.best_path().tolist() == chain[1:]
    assert d.context_store("a") is None  # U only
    assert d.propose("a", node_budget=16).num_drafts == 16  # truncated template
    assert d.propose("a", max_depth=2).num_drafts == 29


def test_token_recycling_allows_repeated_edges_and_prunes_blocked() -> None:
    table = {1: ([2, 3], [0.9, 0.1]), 2: ([1, 3], [0.9, 0.1])}
    d = Drafter(RecapConfig(policy=Policy.TOKEN_RECYCLING, top_k=2, node_budget=80), 10)
    start_with_unigram(d, "a", table, [1])
    assert d.propose("a").best_path().tolist() == [2, 1, 2, 1, 2, 1]
    d2 = Drafter(RecapConfig(policy=Policy.TOKEN_RECYCLING, top_k=2, node_budget=80), 10,
                 blocked_token_ids=[1])
    start_with_unigram(d2, "a", table, [1])
    t = d2.propose("a")
    assert 1 not in t.draft_tokens.tolist() and t.best_path().tolist() == [2, 3]


def test_fixed_tree_uses_fused_q_in_the_template() -> None:
    vocab = 64
    d = Drafter(RecapConfig(tree_shape=TreeShape.FIXED, node_budget=80, suffix_len=0), vocab)
    start_with_unigram(d, "a", _full_unigram(vocab), [7])
    t = d.propose("a")
    assert 60 <= t.num_drafts <= 80  # repeated edges prune a few template nodes
    assert t.depths.max() <= 6


# ---------------------------------------------------------------- invariants


def best_chain(tree: DraftTree) -> list[int]:
    chain, v = [], 0
    while True:
        kids = [i for i in range(1, tree.num_nodes) if tree.parents[i] == v]
        if not kids:
            return chain
        v = max(kids, key=lambda i: (tree.scores[i], -i))
        chain.append(v)


def check_invariants(tree: DraftTree, root: int, cfg: RecapConfig, blocked: set[int],
                     evidence: bool, budget: int | None = None) -> None:
    """Every proposal: a parents-first tree within its budgets, no blocked token, scores
    never above the parent's, best chain first; (RECAP) memory nodes never repeat an edge
    of their path; (evidence) source bits on every draft and a layout best node first."""
    n = tree.num_nodes
    policy, k, suffix_len = cfg.policy, cfg.top_k, cfg.suffix_len
    budget = cfg.node_budget if budget is None else budget
    # Width <= K from the memories; the earliest suffix path may add one more child to a
    # node, evidence continuations SUF_WIDTH per source.
    extra = 0
    if suffix_len and policy is Policy.RECAP:
        extra = 2 * SUF_WIDTH if evidence else 1
    width = np.bincount(tree.parents[1:], minlength=n) if n > 1 else np.zeros(1, np.int64)
    assert width.max() <= k + extra
    assert tree.tokens[0] == root and tree.parents[0] == -1
    depths = tree_depths(tree.parents)  # parents-first
    for m in range(1, n + 1):
        tree_depths(tree.parents[:m])  # every prefix is a tree
    # The builder's depths survive the chain-first relayout.
    assert tree.depths.dtype == np.int64 and tree.depths.tolist() == depths.tolist()
    assert depths.max() <= (max(cfg.max_depth, suffix_len) if evidence else cfg.max_depth)
    cap = min(budget, 80) if policy is Policy.TOKEN_RECYCLING else budget + suffix_len
    # Evidence continuations come on top of the memory budget, so a budget of 0 may still
    # draft them (continuations only); the other modes insert theirs into memory nodes.
    drafts = budget or (evidence and suffix_len)
    assert tree.num_drafts <= (cap if drafts and cfg.max_depth else 0)
    assert not blocked & set(tree.draft_tokens.tolist())
    assert np.all(tree.scores[1:] > 0) and np.all(tree.scores[1:] <= tree.scores[tree.parents[1:]])
    if evidence and n > 1:
        assert tree.sources is not None and tree.sources[0] == 0 and np.all(tree.sources[1:] > 0)
        rest = tree.scores[1 + tree.chain_len:]  # after the best chain: best node first
        assert np.all(np.diff(rest) <= 0)
        memory_only = tree.sources == SOURCE_MEMORY
        assert np.all(depths[memory_only] <= cfg.max_depth)
        assert np.count_nonzero(memory_only) <= budget
    elif n > 1 and policy is Policy.RECAP:
        assert tree.sources is None
    for i in range(1, n):
        sib = [j for j in range(1, n) if tree.parents[j] == tree.parents[i] and j != i]
        assert all(tree.tokens[j] != tree.tokens[i] for j in sib)
        # No edge (parent token, child token) twice on a path -- except where copied text
        # repeats it (evidence continuations copy text as it is, so with evidence only a
        # memory node's own edge must be new on its path).
        if policy is Policy.RECAP and (not evidence or tree.sources[i] == SOURCE_MEMORY):
            edges, v = [], i
            while tree.parents[v] >= 0:
                edges.append((int(tree.tokens[tree.parents[v]]), int(tree.tokens[v])))
                v = tree.parents[v]
            if evidence:
                assert edges[0] not in edges[1:]
            else:
                assert len(edges) == len(set(edges))
    chain = best_chain(tree)
    assert chain == list(range(1, len(chain) + 1)) and tree.chain_len == len(chain)


def evidence(cfg: RecapConfig) -> bool:
    """True if the config builds evidence trees (RECAP, best-first, suffix_mode evidence)."""
    return (cfg.policy is Policy.RECAP and cfg.tree_shape is TreeShape.BEST_FIRST
            and cfg.suffix_mode is SuffixMode.EVIDENCE)


@st.composite
def scenarios(draw: st.DrawFn) -> dict:
    vocab = 12
    k = draw(st.sampled_from([2, 4]))
    cfg = RecapConfig(
        top_k=k, node_budget=draw(st.integers(0, 30)), max_depth=draw(st.integers(1, 6)),
        suffix_len=draw(st.integers(0, 4)), fusion=draw(st.sampled_from(list(FusionMode))),
        policy=draw(st.sampled_from(list(Policy))),
        tree_shape=draw(st.sampled_from(list(TreeShape))),
        use_context_memories=draw(st.booleans()), suffix_prior=draw(st.sampled_from([0.3, 1.0])),
        suffix_mode=draw(st.sampled_from(list(SuffixMode))),
        suffix_min_prob=draw(st.sampled_from([0.0, 0.1, 0.5])),
        calibrated_scores=draw(st.booleans()),
        shared_index=draw(st.sampled_from(list(SharedIndexMode))))
    blocked = draw(st.sets(st.integers(0, vocab - 1), max_size=3))
    # A small alphabet for history and commits so most roots have rows to draft from.
    history = draw(st.lists(st.integers(0, 5), min_size=1, max_size=12))
    prompt_ids = [draw(st.permutations(range(vocab)))[:k] for _ in history]
    prompt_probs = [[draw(st.integers(1, 9)) for _ in range(k)] for _ in history]
    steps = []
    for _ in range(draw(st.integers(0, 5))):
        n = draw(st.integers(1, 6))
        parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
        tokens = [draw(st.integers(0, vocab - 1)) for _ in range(n - 1)]
        ids = [draw(st.permutations(range(vocab)))[:k] for _ in range(n)]
        probs = [[draw(st.integers(1, 9)) for _ in range(k)] for _ in range(n)]
        commit = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
        steps.append((parents, tokens, ids, probs, commit))
    return {"vocab": vocab, "cfg": cfg, "blocked": blocked, "history": history, "steps": steps,
            "prompt_rows": (np.array(prompt_ids), np.array(prompt_probs, np.float64))}


# The case a CI run found (stop 52): node_budget 0 with evidence drafts one continuation.
BUDGET_ZERO_CONTINUATION = {
    "vocab": 12, "blocked": set(), "history": [0, 0], "steps": [],
    "cfg": RecapConfig(top_k=2, max_depth=1, node_budget=0, suffix_len=1,
                       suffix_mode=SuffixMode.EVIDENCE, use_context_memories=False,
                       calibrated_scores=False),
    "prompt_rows": (np.array([[0, 1], [0, 1]]), np.array([[1.0, 1.0], [1.0, 1.0]]))}


@settings(max_examples=150, deadline=None)
@given(scenarios())
@example(BUDGET_ZERO_CONTINUATION)
def test_every_proposal_satisfies_the_tree_invariants(s: dict) -> None:
    # Two drafters fed the same calls must agree exactly (tensor-parallel ranks).
    drafters = [Drafter(s["cfg"], s["vocab"], s["blocked"]) for _ in range(2)]
    for d in drafters:
        d.start("r", s["history"], prompt_rows=s["prompt_rows"])
    trees: list[list[DraftTree]] = [[], []]
    for step in s["steps"] + [None]:
        for j, d in enumerate(drafters):
            tree = d.propose("r")
            trees[j].append(tree)
            c = s["cfg"]
            check_invariants(tree, d.history("r")[-1], c, s["blocked"], evidence(c))
            if step is not None:
                parents, tokens, ids, probs, commit = step
                d.observe("r", [d.history("r")[-1]] + tokens, parents, np.array(ids),
                          np.array(probs, np.float64))
                d.commit("r", commit)
    for a, b in zip(*trees, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
        np.testing.assert_array_equal(a.scores, b.scores)
