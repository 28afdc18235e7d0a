"""Tree rows decided from their largest logits == the whole-row path, draw for draw.

The reference is the whole-row path the candidate walk replaces: ``process_tree_logits``
(itself tested against vLLM's sequential sampler in test_tree_sampling.py), ``verify_trees``'
draws with the same generators, and ``topk_rows`` of the processed rows for the memories.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_tree_sampling import random_forest
from vllm_recap.vllm.candidate_walk import CANDIDATES, from_candidates, walk_rows
from vllm_recap.vllm.tree_sampling import RequestSampling, process_tree_logits
from vllm_recap.vllm.tree_walk import verify_trees
from vllm_recap.vllm.verifier import topk_rows

pytestmark = pytest.mark.unit

MEMORY_K = 8


def _resolve_all(rows):
    """Every pending row processed whole, as the walk-free reference needs them."""
    for r in sorted(rows.pending):
        rows.resolve(r)
    return rows


def _both(logits: torch.Tensor, tree, requests, seeds: list[int | None], torch_seed: int):
    """(candidate walk result, whole-row targets [N], whole-row memory rows)."""
    def with_generators():
        return [RequestSampling(**{**rs.__dict__,
                                   "generator": None if s is None else
                                   torch.Generator().manual_seed(s)})
                for rs, s in zip(requests, seeds)]

    path = tree.path_tokens()
    paths = [path[n, :tree.depth[n]].tolist() for n in range(tree.num_nodes)]
    top = torch.topk(logits, min(CANDIDATES, logits.shape[1]), dim=1)
    torch.manual_seed(torch_seed)
    got = _resolve_all(walk_rows(top.values.numpy(), top.indices.numpy().astype(np.int64),
                                 tree.req, paths, with_generators(), MEMORY_K,
                                 lambda r: logits[r]))
    torch.manual_seed(torch_seed)
    reqs = with_generators()
    processed = process_tree_logits(logits, tree, reqs)
    want = verify_trees(processed, tree, reqs).target
    return got, want, topk_rows(processed, MEMORY_K)


def _request(draw_or_rng, prompt, output, temperature, top_k, top_p, rep=1.0, freq=0.0,
             pres=0.0) -> RequestSampling:
    # as tree_verify._request_states hands greedy-equivalent requests over: temperature 0
    greedy = temperature == 0.0 or top_k == 1
    return RequestSampling(prompt, output, temperature=0.0 if greedy else temperature,
                           top_k=top_k, top_p=top_p, repetition_penalty=rep,
                           frequency_penalty=freq, presence_penalty=pres)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_candidate_walk_equals_whole_rows(data):
    """Targets (argmax or seeded and unseeded draws) and memory rows (ids and probabilities,
    bit for bit) equal the whole-row path's, rows the candidates decide and rows processed
    whole alike; Qwen2.5's text settings are among the cases, mixed with greedy-equivalent
    requests in one step."""
    vocab = data.draw(st.sampled_from([80, 200, 1000]))
    tok = st.integers(0, vocab - 1)
    requests, sizes, seeds = [], [], []
    for _ in range(data.draw(st.integers(1, 3))):
        requests.append(_request(
            None, data.draw(st.lists(tok, min_size=1, max_size=30)),
            data.draw(st.lists(tok, min_size=1, max_size=20)),
            data.draw(st.sampled_from([0.0, 0.5, 0.7, 1.0])),
            data.draw(st.sampled_from([1, 2, 20, 40, CANDIDATES - 8])),
            data.draw(st.sampled_from([1.0, 0.95, 0.8, 0.3])),
            rep=data.draw(st.sampled_from([1.0, 1.05, 1.5])),
            freq=data.draw(st.sampled_from([0.0, 0.3])),
            pres=data.draw(st.sampled_from([0.0, 0.2]))))
        sizes.append(data.draw(st.integers(1, 9)))
        seeds.append(data.draw(st.one_of(st.none(), st.integers(0, 2**31 - 1))))
    assert all(from_candidates(r) for r in requests)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    tree = random_forest(rng, requests, sizes, n_tokens=min(vocab, 40))
    scale = data.draw(st.sampled_from([1.0, 3.0, 8.0]))
    logits = torch.from_numpy((rng.standard_normal((tree.num_nodes, vocab)) * scale)
                              .astype(np.float32))
    got, want, (mem_ids, mem_probs) = _both(logits, tree, requests, seeds,
                                            data.draw(st.integers(0, 1000)))
    assert got.target.tolist() == want.tolist()
    # bit for bit, so the drafter sees the same memories on either path
    np.testing.assert_array_equal(got.memory_ids, mem_ids)
    np.testing.assert_array_equal(got.memory_probs, mem_probs)


def test_qwen_text_rows_are_decided_and_equal():
    """Qwen2.5's text settings (T 0.7, top_k 20, top_p 0.8, repetition 1.05) on model-like
    rows (a few strong logits over a wide spread one): at most 5% of the rows need whole-row
    processing (a cumulative probability within 1e-4 of the top-p cut is left to them), and
    every step's 14 draws, seeded and unseeded, equal the whole-row path's."""
    rng = np.random.default_rng(0)
    vocab = 4096
    requests = [_request(None, rng.integers(0, vocab, 40).tolist(),
                         rng.integers(0, vocab, 10).tolist(), 0.7, 20, 0.8, rep=1.05)
                for _ in range(2)]
    tree = random_forest(rng, requests, [9, 5], n_tokens=50)
    whole = 0
    for trial in range(40):
        logits = rng.standard_normal((tree.num_nodes, vocab)).astype(np.float32) * 2
        logits[:, :50] += rng.uniform(2, 8, (tree.num_nodes, 50)).astype(np.float32)
        got, want, _ = _both(torch.from_numpy(logits), tree, requests, [trial, None], trial)
        assert got.target.tolist() == want.tolist()
        whole += got.whole_rows
    assert whole <= 0.05 * 40 * tree.num_nodes


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_undecided_rows_are_processed_whole(temperature):
    """Rows whose candidates do not decide them (here every logit equal: the k-th processed
    candidate is not above the C-th raw value, and vLLM's sort picks among the ties) are
    processed whole, with the draw the whole-row path makes."""
    rs = _request(None, [1, 2], [3], temperature, 20, 0.8, rep=1.05)
    tree = random_forest(np.random.default_rng(1), [rs], [3], n_tokens=10)
    logits = torch.zeros(tree.num_nodes, 200)
    got, want, (mem_ids, mem_probs) = _both(logits, tree, [rs], [5], 0)
    assert got.whole_rows == tree.num_nodes
    assert got.target.tolist() == want.tolist()
    np.testing.assert_array_equal(got.memory_ids, mem_ids)
    np.testing.assert_array_equal(got.memory_probs, mem_probs)


@pytest.mark.parametrize("kw", [dict(top_k=0), dict(top_k=CANDIDATES), dict(min_p=0.1),
                                dict(repetition_penalty=0.9), dict(logit_bias={1: 2.0}),
                                dict(frequency_penalty=-0.5)])
def test_requests_outside_the_rule_are_not_taken(kw):
    """top-k off or too wide, min-p, penalties that raise logits, logit bias: whole rows."""
    base = dict(temperature=0.7, top_k=20, top_p=0.8)
    assert from_candidates(RequestSampling([1], [2], **base))
    assert not from_candidates(RequestSampling([1], [2], **{**base, **kw}))


def _tie_heavy(tree, vocab: int, rng) -> torch.Tensor:
    """Rows no candidate set decides (more than CANDIDATES entries tied at 0, the top-p cut
    among them) with a strong logit on one child's token, so walks go deep."""
    logits = torch.zeros(tree.num_nodes, vocab)
    for n in range(tree.num_nodes):
        kids = np.flatnonzero(tree.parent == n)
        if len(kids) and rng.random() < 0.8:
            logits[n, int(tree.token[rng.choice(kids)])] = 6.0
    return logits


def _run(logits, tree, requests, seeds, lazy: bool):
    from types import SimpleNamespace

    from vllm_recap.vllm.tree_verify import _walk_plain, _walk_resolving

    reqs = [RequestSampling(**{**rs.__dict__, "generator": None if s is None else
                               torch.Generator().manual_seed(s)})
            for rs, s in zip(requests, seeds)]
    path = tree.path_tokens()
    paths = [path[n, :tree.depth[n]].tolist() for n in range(tree.num_nodes)]
    top = torch.topk(logits, CANDIDATES, dim=1)
    torch.manual_seed(0)
    rows = walk_rows(top.values.numpy(), top.indices.numpy().astype(np.int64), tree.req, paths,
                     reqs, MEMORY_K, lambda r: logits[r])
    def local(r):  # request r's tree: its nodes' parents within the tree (root -1)
        parent, first = tree.parent[tree.req == r], np.flatnonzero(tree.req == r)[0]
        return SimpleNamespace(num_nodes=len(parent),
                               parents=np.where(parent >= 0, parent - first, -1))

    plan = SimpleNamespace(verified=[local(r) for r in range(len(requests))])
    tokens = np.asarray(tree.token, np.int64)
    if lazy:
        return _walk_resolving(plan, tokens, rows), rows
    return _walk_plain(plan, tokens, _resolve_all(rows).target), rows


@pytest.mark.parametrize("seed", range(6))
def test_walks_process_only_the_undecided_rows_they_reach(seed):
    """A row the candidates do not decide is processed whole only when a walk reaches it
    (one whole row is a sort of the vocabulary): the walks equal walks over every row
    processed whole, seeded draws included, every resolved row is one a walk visited, and
    rows no walk reached stay pending with their candidates' memory rows."""
    rng = np.random.default_rng(seed)
    vocab = 300
    requests = [_request(None, rng.integers(0, 12, 8).tolist(), rng.integers(0, 12, 4).tolist(),
                         t, 20, 0.8, rep=1.05) for t in (0.7, 0.0, 0.7)]
    tree = random_forest(rng, requests, [9, 7, 12], n_tokens=12)
    logits = _tie_heavy(tree, vocab, rng)
    seeds = [seed, None, seed + 100]
    eager, all_rows = _run(logits, tree, requests, seeds, lazy=False)
    lazy, rows = _run(logits, tree, requests, seeds, lazy=True)
    assert lazy.tokens == eager.tokens
    assert [a.tolist() for a in lazy.nodes] == [a.tolist() for a in eager.nodes]
    assert all_rows.whole_rows == tree.num_nodes  # every row was undecided
    starts = np.r_[0, np.cumsum([(tree.req == r).sum() for r in range(len(requests))])]
    visited = {int(s) + int(v) for s, nodes in zip(starts, lazy.nodes) for v in [0, *nodes]}
    resolved = set(range(tree.num_nodes)) - rows.pending
    assert resolved == visited  # every walk passed only through rows it had to process
    assert rows.whole_rows == len(resolved) < tree.num_nodes
    # resolved rows' memory rows are the whole-row path's
    for r in resolved:
        np.testing.assert_array_equal(rows.memory_ids[r], all_rows.memory_ids[r])
        np.testing.assert_array_equal(rows.memory_probs[r], all_rows.memory_probs[r])
    assert (rows.target[sorted(rows.pending)] == -1).all()


def test_pending_rows_resolve_alike_in_any_order():
    """Every row's uniform is drawn before any row is resolved, so resolving rows late and in
    any order draws what resolving them at once draws."""
    rng = np.random.default_rng(3)
    requests = [_request(None, [1, 2, 3], [4, 5], 0.7, 20, 0.8, rep=1.05)]
    tree = random_forest(rng, requests, [10], n_tokens=12)
    logits = _tie_heavy(tree, 300, rng)
    path = tree.path_tokens()
    paths = [path[n, :tree.depth[n]].tolist() for n in range(tree.num_nodes)]
    top = torch.topk(logits, CANDIDATES, dim=1)
    out = []
    for order in (range(tree.num_nodes), reversed(range(tree.num_nodes))):
        reqs = [RequestSampling(**{**requests[0].__dict__,
                                   "generator": torch.Generator().manual_seed(7)})]
        rows = walk_rows(top.values.numpy(), top.indices.numpy().astype(np.int64), tree.req,
                         paths, reqs, MEMORY_K, lambda r: logits[r])
        assert len(rows.pending) == tree.num_nodes
        out.append([rows.resolve(r) for r in order])
    assert out[0] == out[1][::-1]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_compiled_sampled_rows_equal_vllms_rules_on_the_candidates(data):
    """core.candidates.sample_candidates (one compiled call) == the torch composition it
    replaced: vLLM's top-k / top-p rules as ``filter_sorted`` replays them, the softmax over the
    kept candidates and ``sample_rows``' inverse CDF in token-id order, with the same uniforms.
    Rows both call decided keep the same candidates and draw the same token; the decision
    itself agrees except within float32 rounding of the top-p cut's margin. Logits from a
    coarse grid: ties at the k-th value and across the cut."""
    from vllm_recap.core.candidates import CUT_MARGIN, sample_candidates
    from vllm_recap.vllm.top_k_top_p import filter_sorted
    from vllm_recap.vllm.tree_walk import sample_rows

    s, c = data.draw(st.integers(1, 6)), data.draw(st.integers(2, 24))
    grid = st.sampled_from([-4.0, -2.5, -1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 1.5, 3.0])
    vals = -np.sort(-np.array(data.draw(st.lists(grid, min_size=s * c, max_size=s * c)),
                              np.float32).reshape(s, c), axis=1)
    ids = np.array([data.draw(st.permutations(range(40)))[:c] for _ in range(s)], np.int64)
    rest = np.array([data.draw(st.sampled_from([-9.0, -4.0, -1.0])) for _ in range(s)],
                    np.float32)
    temp = np.array([data.draw(st.sampled_from([0.3, 0.7, 1.0, 1.3])) for _ in range(s)],
                    np.float32)
    k = np.array([data.draw(st.integers(1, c)) for _ in range(s)], np.int64)
    p = (np.array([data.draw(st.sampled_from([0.5, 0.8, 0.95, 1.0])) for _ in range(s)],
                  np.float32) if data.draw(st.booleans()) else None)
    u = np.array([data.draw(st.floats(0.0, 1.0, width=32, exclude_max=True)) for _ in range(s)], np.float32)

    x, drawn, exact = sample_candidates(vals, ids, rest, temp, k, p, u)

    xt = torch.from_numpy(vals / temp[:, None])
    keep, want_exact = filter_sorted(xt, torch.from_numpy(k), None if p is None else
                                     torch.from_numpy(p), torch.from_numpy(rest / temp))
    xt = xt.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(xt, dim=-1)
    by_id = torch.from_numpy(np.argsort(ids, axis=1, kind="stable"))
    picked = sample_rows(probs.gather(1, by_id), uniforms=torch.from_numpy(u)[:, None])
    want_drawn = ids[np.arange(s), by_id.gather(1, picked[:, None]).view(-1).numpy()]
    for r in range(s):
        if bool(want_exact[r]) != bool(exact[r]):  # only at the top-p cut's margin
            assert p is not None
            survivors = torch.from_numpy(vals[r] / temp[r]) >= float(xt[r, k[r] - 1])
            masked = torch.from_numpy(vals[r] / temp[r]).masked_fill(~survivors, float("-inf"))
            t = masked.softmax(-1).flip(0).cumsum(0).flip(0)
            gap = (t - (1 - float(p[r]))).abs()[1:][survivors[1:]]
            assert gap.numel() and float(gap.min()) == pytest.approx(CUT_MARGIN, abs=1e-6)
            continue
        if exact[r]:
            assert np.array_equal(np.isfinite(x[r]), keep[r].numpy())
            assert np.array_equal(x[r][np.isfinite(x[r])], xt[r].numpy()[keep[r].numpy()])
            cdf = probs.gather(1, by_id)[r].cumsum(0) / probs[r].sum()
            if float((cdf - float(u[r])).abs().min()) > 1e-5:  # not on a boundary
                assert drawn[r] == want_drawn[r]
