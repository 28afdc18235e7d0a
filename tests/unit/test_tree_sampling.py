"""Tree sampling against vLLM's own sequential sampler: processed rows, walks, logprobs.

The reference is vLLM's code path: a real InputBatch holding one hypothetical sequence per tree
node (output = request output + path tokens), its SamplingMetadata, the builtin logits
processors as ``build_logitsprocs`` makes them without speculation, and ``Sampler``'s
``apply_logits_processors`` / ``sample`` / ``forward``.
"""
from __future__ import annotations

import types
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from vllm_recap.vllm.eligibility import tree_unsupported_reason
from vllm_recap.vllm.tree_sampling import RequestSampling, TreeBatch, process_tree_logits
from vllm_recap.vllm.tree_walk import (
    children_mass,
    greedy_walk,
    sample_walk,
    tree_logprobs,
    verify_trees,
    walk_targets,
    walk_visited,
)

pytestmark = pytest.mark.unit

EOS = 3


def make_params(**kw) -> SamplingParams:
    """SamplingParams as the engine hands them over: EOS added, bad words tokenized."""
    bad = kw.pop("bad_words_token_ids", None)
    params = SamplingParams(**kw)
    params.update_from_generation_config({}, eos_token_id=EOS)
    if bad:
        params.bad_words = [f"w{i}" for i in range(len(bad))]
        params._bad_words_token_ids = [list(w) for w in bad]
    return params


def vllm_sequential(logits: torch.Tensor, contexts):
    """vLLM processing each row as the next position of its own sequence.

    Args:
        logits: [M, V]; contexts: M (params, prompt ids, output ids).
    Returns:
        (batch, [M, V] the rows vLLM decides on: penalised logits for greedy rows, the
        processed logits it samples from for the others).
    """
    m, vocab = logits.shape
    cfg = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=m))
    procs = LogitsProcessors(c(cfg, torch.device("cpu"), False) for c in BUILTIN_LOGITS_PROCESSORS)
    longest = max(len(p) + len(o) for _, p, o in contexts) + 8
    batch = InputBatch(max_num_reqs=m, max_model_len=longest, max_num_batched_tokens=longest,
                       device=torch.device("cpu"), vocab_size=vocab, block_sizes=[16],
                       max_num_blocks_per_req=[longest // 16 + 1], logitsprocs=procs)
    for i, (params, prompt, out) in enumerate(contexts):
        batch.add_request(CachedRequestState(
            req_id=str(i), prompt_token_ids=list(prompt), mm_features=[],
            sampling_params=params, generator=None, block_ids=([],), num_computed_tokens=0,
            output_token_ids=list(out)))
    batch.refresh_metadata()
    md = batch.sampling_metadata
    sampler = Sampler(logprobs_mode="processed_logits")
    # The sampler works in place (and .to() of float32 is a no-op): hand it a copy.
    pre = sampler.apply_logits_processors(logits.to(torch.float32, copy=True), md, False)
    decided = pre.clone()
    if not md.all_greedy:
        _, processed = sampler.sample(pre, md)
        greedy = torch.tensor([p.temperature < 1e-5 for p, _, _ in contexts])
        decided[~greedy] = processed[~greedy]
    return batch, decided


def random_forest(rng, requests, sizes, n_tokens=12):
    """Random trees (tokens from a small set so paths repeat tokens); roots = last token."""
    req, parent, token = [], [], []
    for r, (rs, size) in enumerate(zip(requests, sizes)):
        base = len(req)
        last = (list(rs.prompt_token_ids) + list(rs.output_token_ids))[-1]
        for i in range(size):
            req.append(r)
            parent.append(-1 if i == 0 else base + int(rng.integers(0, i)))
            token.append(last if i == 0 else int(rng.integers(0, n_tokens)))
    return TreeBatch.from_parents(req, parent, token)


def node_contexts(tree, requests, params):
    path = tree.path_tokens()
    return [(params[r], requests[r].prompt_token_ids,
             list(requests[r].output_token_ids) + path[n, :tree.depth[n]].tolist())
            for n, r in enumerate(tree.req)]


# --- process_tree_logits == vLLM's sequential processing, row by row -----------------------

ALL = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, min_tokens=5,
           bad_words_token_ids=[[7], [4, 5, 6], [1, 2]], logit_bias={3: 4.0, 8: -2.5})
CASES = {
    "repetition": dict(temperature=0.0, repetition_penalty=1.4),
    "presence": dict(temperature=0.0, presence_penalty=0.8),
    "frequency": dict(temperature=0.0, frequency_penalty=-0.6),
    "min_tokens": dict(temperature=0.0, min_tokens=5, stop_token_ids=[5, 9]),
    "bad_words_single": dict(temperature=0.0, bad_words_token_ids=[[7], [11]]),
    "bad_words_multi": dict(temperature=0.0, bad_words_token_ids="from_tree"),
    "allowed_ids": dict(temperature=0.0, allowed_token_ids=list(range(0, 40, 2))),
    "logit_bias": dict(temperature=0.0, logit_bias={3: 5.0, 8: -2.5, 40: 100.0}),
    "min_p": dict(temperature=1.0, min_p=0.2),
    "top_k_top_p": dict(temperature=0.9, top_k=10, top_p=0.7),
    "qwen25_vl": dict(temperature=0.1, top_k=1, top_p=0.001, repetition_penalty=1.05),
    "qwen25_text": dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    "all_greedy": dict(temperature=0.0, allowed_token_ids=list(range(48)), **ALL),
    "all_sampled": dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05, **ALL),
}


def _bad_words_from_tree(tree, requests):
    """Multi-token bad words whose prefixes occur on request 0's paths and across its output
    boundary; returns them and the deepest node of request 0 (whose row they must mask)."""
    nodes = np.flatnonzero(tree.req == 0)
    deep = int(nodes[np.argmax(tree.depth[nodes])])
    path = tree.path_tokens()[deep, :tree.depth[deep]].tolist()
    out = list(requests[0].output_token_ids)
    words = [path + [21], out[-1:] + path + [20], out[-2:] + path[:1] + [22], path[-1:] + [23]]
    return words, deep


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_equal_vllm_sequential(case, dtype):
    rng = np.random.default_rng(zlib.crc32(case.encode()))
    kw = dict(CASES[case])
    outs = [[1, 9, 4, 4], [2, 5], [6]]  # min_tokens=5 falls inside the trees for each
    requests = [RequestSampling([2, 7, 7, 10], o) for o in outs]
    tree = random_forest(rng, requests, [9, 7, 6])
    if kw.get("bad_words_token_ids") == "from_tree":
        kw["bad_words_token_ids"], deep = _bad_words_from_tree(tree, requests)
    params = [make_params(**kw) for _ in requests]
    requests = [RequestSampling.from_params(p, r.prompt_token_ids, r.output_token_ids)
                for p, r in zip(params, requests)]
    logits = (torch.randn(tree.num_nodes, 64, generator=torch.Generator().manual_seed(1)) * 3
              ).to(dtype)
    got = process_tree_logits(logits, tree, requests)
    _, want = vllm_sequential(logits, node_contexts(tree, requests, params))
    assert got.dtype == torch.float32
    assert torch.equal(got, want), case
    if case == "bad_words_multi":  # the path-long and boundary-crossing words did fire
        assert torch.isinf(want[deep, [20, 21]]).all()
    if case == "min_tokens":  # the min_tokens threshold falls inside the trees
        stops = want[:, [EOS, 5, 9]].isinf().all(1)
        assert stops.any() and not stops.all()


def test_mixed_batch_rows_equal_vllm_sequential():
    rng = np.random.default_rng(7)
    kws = [dict(temperature=0.0, repetition_penalty=1.2, min_tokens=4),
           CASES["qwen25_text"], dict(temperature=1.0), CASES["qwen25_vl"],
           dict(temperature=0.5, bad_words_token_ids=[[4, 5], [9]],
                allowed_token_ids=list(range(30)))]
    params = [make_params(**kw) for kw in kws]
    requests = [RequestSampling.from_params(p, [3, 4, 5], [4, 5, i]) for i, p in enumerate(params)]
    tree = random_forest(rng, requests, [8, 8, 5, 6, 7])
    logits = torch.randn(tree.num_nodes, 64, generator=torch.Generator().manual_seed(2)) * 3
    _, want = vllm_sequential(logits, node_contexts(tree, requests, params))
    assert torch.equal(process_tree_logits(logits, tree, requests), want)


def test_qwen_text_tree_rows_skip_vllms_vocabulary_sort(monkeypatch):
    """Qwen2.5 text settings (T 0.7, top_k 20, top_p 0.8) on 49k-wide rows: the processed rows
    equal vLLM's, and only rows with equal logits across the top-p cut are sorted (before,
    every row went through vLLM's sorting filter: ~2-3 ms a row on a 2-core CPU)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    rng = np.random.default_rng(11)
    params = [make_params(**CASES["qwen25_text"]) for _ in range(2)]
    requests = [RequestSampling.from_params(p, [3, 4, 5], [4, 5, i]) for i, p in enumerate(params)]
    tree = random_forest(rng, requests, [9, 8])
    g = torch.Generator().manual_seed(5)
    vocab = 49152
    logits = torch.randn(tree.num_nodes, vocab, generator=g) * 2
    top = torch.randperm(vocab, generator=g)[:40]  # a language model's few dozen candidates
    logits[:, top] += torch.linspace(14, 4, 40) + torch.rand(tree.num_nodes, 40, generator=g)
    logits = logits.to(torch.bfloat16)
    _, want = vllm_sequential(logits, node_contexts(tree, requests, params))
    sorted_rows = []
    original = topk_topp_sampler.apply_top_k_top_p

    def counting(x, k, p):
        sorted_rows.append(x.shape[0])
        return original(x, k, p)

    monkeypatch.setattr(topk_topp_sampler, "apply_top_k_top_p", counting)
    assert torch.equal(process_tree_logits(logits, tree, requests), want)
    assert sum(sorted_rows) <= 2, sorted_rows  # of 17


# --- tree structure -----------------------------------------------------------------------

def test_tree_batch_golden_and_errors():
    tree = TreeBatch.from_parents([0, 0, 0, 0, 1, 1], [-1, 0, 0, 1, -1, 4], [5, 6, 7, 8, 9, 10])
    assert tree.depth.tolist() == [0, 1, 1, 2, 0, 1]
    assert tree.path_nodes.tolist() == [[-1, -1], [1, -1], [2, -1], [1, 3], [-1, -1], [5, -1]]
    assert tree.path_tokens().tolist() == [[-1, -1], [6, -1], [7, -1], [6, 8], [-1, -1], [10, -1]]
    assert tree.roots.tolist() == [0, 4] and tree.tree_of.tolist() == [0, 0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="earlier node"):
        TreeBatch.from_parents([0, 0], [-1, 1], [1, 2])
    with pytest.raises(ValueError, match="another request"):
        TreeBatch.from_parents([0, 1], [-1, 0], [1, 2])
    with pytest.raises(ValueError, match="more than one root"):
        TreeBatch.from_parents([0, 0], [-1, -1], [1, 2])
    with pytest.raises(ValueError, match="equal in length"):
        TreeBatch.from_parents([0], [-1, 0], [1, 2])
    with pytest.raises(ValueError, match="no RequestSampling"):
        process_tree_logits(torch.zeros(6, 16), tree, [RequestSampling([1], [5])])


# --- greedy walks -------------------------------------------------------------------------

def _rows(v, peaks):
    """[len(peaks), v] logits with the given argmax per row (ties: a list of tokens)."""
    x = torch.zeros(len(peaks), v)
    for i, p in enumerate(peaks):
        x[i, p] = 5.0
    return x


def test_greedy_walk_golden():
    # tree 0: root(1) -> a(2), b(3); b -> c(4), d(5); d -> e(6)     tree 1: root(1) -> f(2)
    tree = TreeBatch.from_parents([0, 0, 0, 0, 0, 0, 1, 1], [-1, 0, 0, 2, 2, 4, -1, 6],
                                  [1, 2, 3, 4, 5, 6, 1, 2])
    # Row argmax: root -> 3 (b), b -> 5 (d), d -> 7 (no such child: commit 7). Tree 1's root
    # row ties 4 and 2: vLLM takes the lowest id, 2 -> f; f -> 0.
    logits = _rows(8, [3, 0, 5, 0, 7, 0, [4, 2], 0])
    walk = greedy_walk(logits, tree)
    assert [a.tolist() for a in walk.accepted] == [[2, 4], [7]]
    assert walk.committed.tolist() == [7, 0]
    assert walk.output_tokens(tree) == [[3, 5, 7], [2, 0]]
    assert Sampler.greedy_sample(logits[6:7]).tolist() == [2]  # vLLM's tie rule, same row
    # Duplicate sibling tokens are redundant drafts: the lowest node index is followed.
    dup = TreeBatch.from_parents([0, 0, 0, 0], [-1, 0, 0, 2], [1, 2, 2, 3])
    assert greedy_walk(_rows(8, [2, 5, 3, 0]), dup).accepted[0].tolist() == [1]


def test_greedy_walk_equals_walking_by_hand():
    rng = np.random.default_rng(3)
    requests = [RequestSampling([1], [i % 4]) for i in range(6)]
    tree = random_forest(rng, requests, [12, 9, 15, 4, 1, 10], n_tokens=4)
    logits = torch.randn(tree.num_nodes, 4, generator=torch.Generator().manual_seed(3))
    walk = greedy_walk(logits, tree)
    for t, root in enumerate(tree.roots):
        node, path = int(root), []
        while True:
            best = int(torch.argmax(logits[node]))
            kids = [c for c in range(tree.num_nodes) if tree.parent[c] == node
                    and tree.token[c] == best]
            if not kids:
                break
            node = kids[0]
            path.append(node)
        assert walk.accepted[t].tolist() == path and walk.committed[t] == best


V_SMALL = 8


def order2_model(v, seed, scale=1.5):
    """A tiny 'target model': next-token logits from the last two tokens, [v, v, v]."""
    return torch.randn(v, v, v, generator=torch.Generator().manual_seed(seed)) * scale


def full_tree(context, depth, v):
    """Every continuation up to ``depth`` (v + v^2 ... nodes), root = last context token."""
    parent, token, prev = [-1], [context[-1]], [context[-2]]
    frontier = [0]
    for _ in range(depth):
        nxt = []
        for p in frontier:
            for t in range(v):
                parent.append(p)
                prev.append(token[p])
                token.append(t)
                nxt.append(len(token) - 1)
        frontier = nxt
    return TreeBatch.from_parents([0] * len(token), parent, token), torch.tensor(prev)


def test_greedy_trees_token_identical_to_sequential_vllm():
    """Greedy decoding with strong penalties: tree verification == vLLM one token at a time."""
    model = order2_model(V_SMALL, 0)
    params = make_params(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.7,
                         min_tokens=3, bad_words_token_ids=[[1, 2], [5]])
    prompt = [0, 1]
    seq = []
    while len(seq) < 9:
        ctx = prompt + seq
        _, row = vllm_sequential(model[ctx[-2], ctx[-1]][None], [(params, prompt, seq)])
        seq.append(int(Sampler.greedy_sample(row)))
    got = []
    while len(got) < 9:
        tree, prev = full_tree(prompt + got, 2, V_SMALL)
        rs = RequestSampling.from_params(params, prompt, got)
        logits = model[prev, torch.as_tensor(tree.token)]
        walk = verify_trees(process_tree_logits(logits, tree, [rs]), tree, [rs])
        assert len(walk.accepted[0]) == 2  # the full tree always holds the greedy path
        got += walk.output_tokens(tree)[0]
    assert got[:9] == seq


# --- lossless sampling: distribution test with power --------------------------------------

V_DIST, BRANCH = 5, (3, 2, 2)
DIST_KW = dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.3)


def _template():
    parent, rank, level = [-1], [0], [0]
    frontier = [0]
    for depth, b in enumerate(BRANCH, 1):
        nxt = []
        for p in frontier:
            for j in range(b):
                parent.append(p)
                rank.append(j)
                level.append(depth)
                nxt.append(len(parent) - 1)
        frontier = nxt
    return np.array(parent), np.array(rank), np.array(level)


def draft_trees(contexts, draft_top):
    """Deterministic drafts: each node's children are the draft's top tokens, best first."""
    parent, rank, level = _template()
    m, b = len(parent), len(contexts)
    tok, prev = np.zeros((b, m), np.int64), np.zeros((b, m), np.int64)
    tok[:, 0] = [c[-1] for c in contexts]
    prev[:, 0] = [c[-2] for c in contexts]
    for n in range(1, m):  # template loop (16 nodes), vectorised over the batch
        p = parent[n]
        tok[:, n] = draft_top[prev[:, p], tok[:, p], rank[n]]
        prev[:, n] = tok[:, p]
    offs = (np.arange(b) * m)[:, None]
    gparent = np.where(parent[None] >= 0, parent[None] + offs, -1)
    tree = TreeBatch.from_parents(np.repeat(np.arange(b), m), gparent.ravel(), tok.ravel())
    return tree, torch.as_tensor(prev.ravel())


def first_child_token(tree):
    first = np.full(tree.num_nodes, -1)
    kids = np.flatnonzero(tree.parent >= 0)[::-1]  # reversed: the lowest index writes last
    first[tree.parent[kids]] = tree.token[kids]
    return first


def correct_walker(processed, tree, requests):
    return sample_walk(processed, tree, requests)


def wrong_first_child_in_top2(processed, tree, requests):
    """Takes the best-drafted child whenever it is in the target's top 2, else samples."""
    probs = processed.softmax(-1)
    target = torch.multinomial(probs, 1).view(-1).numpy()
    first = first_child_token(tree)
    top2 = torch.topk(probs, 2).indices.numpy()
    take = (first >= 0) & (top2 == first[:, None]).any(1)
    return walk_targets(tree, np.where(take, first, target))


def wrong_child_by_draft_score(processed, tree, requests):
    """Goes deeper with the right probability p(children) but picks the child by draft rank."""
    probs = processed.softmax(-1)
    mass = children_mass(probs, tree)
    others = probs.clone()
    kids = np.flatnonzero(tree.parent >= 0)
    others[torch.as_tensor(tree.parent[kids]), torch.as_tensor(tree.token[kids])] = 0
    others[others.sum(-1) == 0] = 1.0
    rest = torch.multinomial(others, 1).view(-1).numpy()
    go = torch.rand(tree.num_nodes).numpy() < mass
    return walk_targets(tree, np.where(go, first_child_token(tree), rest))


def first_tokens(walker, model, draft_top, params, prompt, n_seq, k=3):
    outs = [[] for _ in range(n_seq)]
    active = list(range(n_seq))
    while active:
        contexts = [prompt + outs[s] for s in active]
        tree, prev = draft_trees(contexts, draft_top)
        requests = [RequestSampling.from_params(params, prompt, outs[s]) for s in active]
        processed = process_tree_logits(model[prev, torch.as_tensor(tree.token)], tree, requests)
        for s, toks in zip(active, walker(processed, tree, requests).output_tokens(tree)):
            outs[s] += toks
        active = [s for s in active if len(outs[s]) < k]
    return np.array([o[:k] for o in outs])


def exact_first_tokens(model, params, prompt, v):
    """P(t1, t2, t3) of sequential sampling, from vLLM's own processing of every context."""
    outs = [[]] + [[a] for a in range(v)] + [[a, b] for a in range(v) for b in range(v)]
    ctxs = [prompt + o for o in outs]
    logits = torch.stack([model[c[-2], c[-1]] for c in ctxs])
    _, rows = vllm_sequential(logits, [(params, prompt, o) for o in outs])
    p = rows.softmax(-1).double()
    p1, p2, p3 = p[0], p[1:1 + v], p[1 + v:].view(v, v, v)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_pvalue(samples, probs):
    counts = np.bincount(np.ravel_multi_index(samples.T, probs.shape), minlength=probs.numel())
    expected = probs.flatten().numpy() * len(samples)
    small = expected < 5  # pool sparse cells so the chi-square approximation holds
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    stat = float(((obs - exp) ** 2 / np.maximum(exp, 1e-12)).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


ALPHA = 0.001  # stated significance; the correct walker must pass, both wrong ones must fail
N_SEQ = 6000


@pytest.fixture(scope="module")
def dist_setup():
    model = order2_model(V_DIST, 11, scale=1.0)
    draft = torch.randn(V_DIST, V_DIST, V_DIST, generator=torch.Generator().manual_seed(12))
    draft_top = np.argsort(-draft.numpy(), axis=-1)[..., :max(BRANCH)]
    params, prompt = make_params(**DIST_KW), [0, 1]
    return model, draft_top, params, prompt, exact_first_tokens(model, params, prompt, V_DIST)


@pytest.mark.parametrize("walker,should_pass", [
    (correct_walker, True), (wrong_first_child_in_top2, False),
    (wrong_child_by_draft_score, False)])
def test_sample_walk_distribution_with_power(dist_setup, walker, should_pass):
    model, draft_top, params, prompt, exact = dist_setup
    torch.manual_seed(5)
    samples = first_tokens(walker, model, draft_top, params, prompt, N_SEQ)
    pvalue = chi_square_pvalue(samples, exact)
    assert (pvalue > ALPHA) == should_pass, (walker.__name__, pvalue)


def test_sampled_walks_go_deep_and_mass_is_children_probability(dist_setup):
    model, draft_top, params, prompt, _ = dist_setup
    torch.manual_seed(0)
    tree, prev = draft_trees([prompt] * 200, draft_top)
    requests = [RequestSampling.from_params(params, prompt, [])] * 200
    processed = process_tree_logits(model[prev, torch.as_tensor(tree.token)], tree, requests)
    walk = sample_walk(processed, tree, requests)
    assert max(len(a) for a in walk.accepted) == len(BRANCH)
    probs = processed.softmax(-1)
    for n in (0, 1, 4):
        kids = set(tree.token[tree.parent == n].tolist())
        assert walk.child_mass[n] == pytest.approx(float(probs[n, sorted(kids)].sum()), abs=1e-6)


def test_sample_rows_frequencies_and_zero_mass(monkeypatch):
    """The inverse-CDF draw: frequencies within 4 sigma of the row's probabilities, a token of
    mass 0 never drawn, and a uniform rounded up to the total lands on the last token of
    positive mass, not past it."""
    from vllm_recap.vllm.tree_walk import sample_rows

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]] * 20000)
    got = np.bincount(sample_rows(probs, torch.Generator().manual_seed(1)).numpy(), minlength=6)
    want = probs[0].numpy() * len(probs)
    assert got[[0, 2, 5]].sum() == 0
    sigma = np.sqrt(want * (1 - probs[0].numpy()))
    assert np.all(np.abs(got - want) <= 4 * sigma + 1e-9), got
    monkeypatch.setattr(torch, "rand", lambda m, n, **kw: torch.ones(m, n))
    assert sample_rows(probs[:3]).tolist() == [4, 4, 4]


def test_seeded_requests_reproducible_and_isolated():
    model = order2_model(V_SMALL, 4, scale=0.5)
    params = make_params(temperature=1.0, seed=3)
    tree, prev = full_tree([0, 1], 2, V_SMALL)
    tree = TreeBatch.from_parents(np.repeat([0, 1], tree.num_nodes),
                                  np.concatenate([tree.parent, np.where(tree.parent >= 0,
                                                  tree.parent + tree.num_nodes, -1)]),
                                  np.tile(tree.token, 2))
    logits = model[prev.repeat(2), torch.as_tensor(tree.token)]

    def run(seed):
        seeded = torch.Generator().manual_seed(seed)
        reqs = [RequestSampling.from_params(params, [0, 1], [], seeded),
                RequestSampling.from_params(params, [0, 1], [])]
        state = torch.get_rng_state()
        walk = sample_walk(process_tree_logits(logits, tree, reqs), tree, reqs)
        torch.set_rng_state(state)
        return walk.output_tokens(tree)[0]

    runs = [run(s) for s in (3, 3, 4, 5, 6, 7)]
    assert runs[0] == runs[1] and any(r != runs[0] for r in runs[2:])
    with pytest.raises(ValueError, match="greedy"):
        greedy_req = RequestSampling.from_params(make_params(temperature=0.0), [0, 1], [])
        sample_walk(logits, tree, [greedy_req, greedy_req])


def test_verify_trees_mixes_greedy_and_sampled():
    tree, prev = full_tree([0, 1], 2, V_SMALL)
    m = tree.num_nodes
    both = TreeBatch.from_parents(np.repeat([0, 1], m), np.concatenate(
        [tree.parent, np.where(tree.parent >= 0, tree.parent + m, -1)]), np.tile(tree.token, 2))
    logits = order2_model(V_SMALL, 9)[prev.repeat(2), torch.as_tensor(both.token)]
    greedy = RequestSampling.from_params(make_params(temperature=0.3, top_k=1), [0, 1], [])
    reqs = [greedy, RequestSampling.from_params(make_params(temperature=1.0), [0, 1], [],
                                                torch.Generator().manual_seed(1))]
    processed = process_tree_logits(logits, both, reqs)
    walk = verify_trees(processed, both, reqs)
    alone = greedy_walk(processed[:m], tree)
    assert walk.output_tokens(both)[0] == alone.output_tokens(tree)[0]
    reqs[1] = RequestSampling.from_params(make_params(temperature=1.0), [0, 1], [],
                                          torch.Generator().manual_seed(1))
    again = sample_walk(processed[m:], tree, [reqs[1]])
    assert walk.output_tokens(both)[1] == again.output_tokens(tree)[0]


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_walking_only_the_visited_rows_equals_walking_every_row(data):
    """``walk_visited`` (rows processed one tree level at a time, only where the walk goes)
    accepts and commits what ``verify_trees`` over every processed row does, its rows are
    those rows bit for bit, and every generator ends in the same state -- for any mix of
    greedy-equivalent and sampled requests, seeded or not, with every kind of processing."""
    seed = data.draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    n_req = data.draw(st.integers(1, 3))
    names = [data.draw(st.sampled_from(sorted(CASES))) for _ in range(n_req)]
    seeds = [data.draw(st.one_of(st.none(), st.integers(0, 99))) for _ in range(n_req)]
    vocab = 48

    def requests():
        out = []
        for name, s in zip(names, seeds):
            kw = {k: v for k, v in CASES[name].items() if k != "bad_words_token_ids"}
            if name.startswith("bad_words"):
                kw["bad_words_token_ids"] = [[7], [4, 5, 6], [1, 2]]
            out.append(RequestSampling([4, 5, 6, 7], [5, 2, 9], **{
                **kw, "generator": None if s is None else torch.Generator().manual_seed(s)}))
        return out

    tree = random_forest(rng, requests(), rng.integers(1, 12, n_req), n_tokens=10)
    logits = torch.from_numpy(rng.normal(size=(tree.num_nodes, vocab)).astype(np.float32))
    # sharp rows whose argmax is a drafted child now and then, so walks go deep
    kids = np.flatnonzero(tree.parent >= 0)
    hit = kids[rng.random(len(kids)) < 0.5]
    logits[torch.from_numpy(tree.parent[hit]), torch.from_numpy(tree.token[hit])] += 6.0

    torch.manual_seed(seed)
    reqs = requests()
    processed = process_tree_logits(logits, tree, reqs)
    want = verify_trees(processed, tree, reqs)
    after_want = [None if r.generator is None else torch.rand(1, generator=r.generator)
                  for r in reqs] + [torch.rand(1)]

    torch.manual_seed(seed)
    reqs = requests()
    asked = []

    def rows(nodes):
        asked.append(nodes.copy())
        return logits[torch.from_numpy(nodes)]

    got, visited, got_rows = walk_visited(rows, tree, reqs)
    after_got = [None if r.generator is None else torch.rand(1, generator=r.generator)
                 for r in reqs] + [torch.rand(1)]
    assert [a.tolist() for a in got.accepted] == [a.tolist() for a in want.accepted]
    assert got.committed.tolist() == want.committed.tolist()
    assert np.concatenate(asked).tolist() == visited.tolist()
    assert sorted(visited.tolist()) == sorted(set(tree.roots.tolist())
                                              | set(np.concatenate(got.accepted).tolist()))
    torch.testing.assert_close(got_rows, processed[torch.from_numpy(visited)], rtol=0, atol=0)
    assert got.target[visited].tolist() == want.target[visited].tolist()
    assert after_got == after_want


# --- logprobs ------------------------------------------------------------------------------

@pytest.fixture()
def eager_rank_count(monkeypatch):
    """vLLM compiles its rank counter with inductor (~20 s cold on 2 cores); same math eager."""
    import vllm.v1.sample.sampler as sampler_mod

    fn = sampler_mod.batched_count_greater_than
    monkeypatch.setattr(sampler_mod, "batched_count_greater_than",
                        getattr(fn, "_torchdynamo_orig_callable", fn))


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs",
                                  "processed_logits"])
def test_tree_logprobs_equal_sequential_vllm(eager_rank_count, mode):
    model = order2_model(V_SMALL, 1)
    params = make_params(temperature=0.0, repetition_penalty=1.5, logprobs=3)
    prompt, out = [0, 1], [2]
    tree, prev = full_tree(prompt + out, 2, V_SMALL)
    rs = RequestSampling.from_params(params, prompt, out)
    raw = model[prev, torch.as_tensor(tree.token)]
    processed = process_tree_logits(raw, tree, [rs])
    walk = greedy_walk(processed, tree)
    got = tree_logprobs(walk, tree, raw, processed, 3, mode)
    rows = walk.rows(tree)[0]
    path = tree.path_tokens()
    batch, _ = vllm_sequential(raw[rows], [(params, prompt, out + path[n, :tree.depth[n]].tolist())
                                           for n in rows])
    want = Sampler(logprobs_mode=mode)(raw[rows], batch.sampling_metadata)
    assert want.sampled_token_ids.view(-1).tolist() == walk.output_tokens(tree)[0]
    for a, b in zip(got[:3], want.logprobs_tensors[:3]):
        assert torch.equal(a, b), mode
    assert got.cu_num_generated_tokens == [0, len(rows)]


def test_tree_logprobs_sampled_processed_rows(eager_rank_count):
    model = order2_model(V_SMALL, 2)
    params = make_params(**CASES["qwen25_text"])
    tree, prev = full_tree([0, 1], 2, V_SMALL)
    rs = RequestSampling.from_params(params, [0, 1], [], torch.Generator().manual_seed(0))
    raw = model[prev, torch.as_tensor(tree.token)]
    processed = process_tree_logits(raw, tree, [rs])
    walk = sample_walk(processed, tree, [rs])
    rows = walk.rows(tree)[0]
    path = tree.path_tokens()
    _, ref = vllm_sequential(raw[rows], [(params, [0, 1], path[n, :tree.depth[n]].tolist())
                                         for n in rows])
    want = Sampler.gather_logprobs(Sampler.compute_logprobs(ref), 2,
                                   torch.tensor(walk.output_tokens(tree)[0]))
    got = tree_logprobs(walk, tree, raw, processed, 2, "processed_logprobs")
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3]))
    with pytest.raises(ValueError, match="mode"):
        tree_logprobs(walk, tree, raw, processed, 2, "logits")


# --- eligibility and request state -------------------------------------------------------

def test_tree_unsupported_reason_allow_list():
    from vllm.sampling_params import StructuredOutputsParams

    assert tree_unsupported_reason(SamplingParams()) is None
    for ok in [CASES["qwen25_vl"], CASES["qwen25_text"], dict(ALL, temperature=0.7),
               dict(seed=1, logprobs=5, n=2, stop=["x"], max_tokens=9, allowed_token_ids=[1]),
               dict(min_p=0.1, logit_bias={1: 1.0}, watermarking=False)]:
        assert tree_unsupported_reason(make_params(**ok)) is None, ok
    for name, kw in {
        "structured_outputs": dict(structured_outputs=StructuredOutputsParams(regex="a+")),
        "logprob_token_ids": dict(logprob_token_ids=[1, 2]),
        "prompt_logprobs": dict(prompt_logprobs=1),
        "extra_args": dict(extra_args={"k": 1}),
        "thinking_token_budget": dict(thinking_token_budget=5),
        "trace_decode_token_ids": dict(trace_decode_token_ids=[1]),
        "watermarking": dict(watermarking=True),
        "prompt_logprob_token_ids": dict(prompt_logprob_token_ids=np.array([[1, 2]])),
    }.items():
        reason = tree_unsupported_reason(SamplingParams(**kw))
        assert reason is not None and name in reason, (name, reason)
    assert tree_unsupported_reason(None) == "no sampling params"


def test_unknown_field_is_not_tree_eligible():
    class FutureParams(SamplingParams):
        new_knob: int = 0

    assert tree_unsupported_reason(FutureParams()) is None  # at its default: harmless
    assert "new_knob" in tree_unsupported_reason(FutureParams(new_knob=2))


def test_request_sampling_from_params():
    params = make_params(temperature=0.0, top_k=5, stop_token_ids=[7], min_tokens=2,
                         bad_words_token_ids=[[1, 2]], logit_bias={4: 1.0})
    rs = RequestSampling.from_params(params, [1, 2], [3])
    assert rs.temperature == 0.0 and rs.is_greedy and rs.greedy_equivalent
    assert rs.top_k == 0  # vLLM resets top_k/top_p/min_p for greedy requests
    assert rs.stop_token_ids == {7, EOS} and rs.bad_words_token_ids == ((1, 2),)
    assert dict(rs.logit_bias) == {4: 1.0} and not rs.has_penalties
    vl = RequestSampling.from_params(make_params(**CASES["qwen25_vl"]), [1], [])
    assert not vl.is_greedy and vl.greedy_equivalent and vl.has_penalties
    assert not RequestSampling.from_params(make_params(top_k=2), [1], []).greedy_equivalent
    with pytest.raises(ValueError, match="prompt_token_ids"):
        RequestSampling.from_params(make_params(repetition_penalty=1.1), None, [])


def test_sampling_eps_and_greedy_tie_rule_are_vllms():
    """tree_sampling keeps a copy of vLLM's epsilon and tree_walk argmaxes with torch (so plain
    greedy trees import no vLLM sampler): both must agree with vLLM's own."""
    from vllm.v1.sample import sampler

    from vllm_recap.vllm import tree_sampling
    from vllm_recap.vllm.tree_walk import greedy_sample

    assert tree_sampling._SAMPLING_EPS == sampler._SAMPLING_EPS
    rows = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 5.0, 5.0]])
    assert greedy_sample(rows).tolist() == Sampler.greedy_sample(rows).tolist() == [1, 0, 2]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_walk_equals_the_core_reference_verifier_on_random_trees(data):
    """The vectorised walk (production) == vllm_recap.core.verify_greedy (the numpy oracle)."""
    from vllm_recap.core import verify_greedy

    n = data.draw(st.integers(1, 24))
    parents = [-1] + [data.draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    argmax = np.array(data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)))
    batch = TreeBatch.from_parents(np.zeros(n, np.int64), parents, tokens)
    walk = walk_targets(batch, argmax)
    accepted, bonus = verify_greedy(np.array(tokens), np.array(parents), argmax)
    assert walk.accepted[0].tolist() == accepted.tolist() and int(walk.committed[0]) == bonus


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_sparse_penalties_equal_vllms_apply_penalties_bit_for_bit(data):
    """apply_penalties_sparse (CPU production path) == vLLM's apply_penalties on the same rows:
    prompt / output / path tokens with duplicates, async -1 placeholders, zero, negative and
    -inf logits, several requests with their own penalties."""
    from vllm.model_executor.layers.utils import apply_penalties

    from vllm_recap.vllm.tree_sampling import apply_penalties_sparse, group_by_request

    vocab = data.draw(st.integers(4, 40))
    tok = st.integers(0, vocab - 1)
    n_req = data.draw(st.integers(1, 3))
    requests, sizes = [], []
    for _ in range(n_req):
        prompt = data.draw(st.lists(tok, min_size=1, max_size=12))
        output = data.draw(st.lists(st.one_of(tok, st.just(-1)), min_size=1, max_size=10))
        output[-1] = data.draw(tok)  # the root's token, committed
        pen = dict(repetition_penalty=data.draw(st.sampled_from([1.0, 1.05, 1.3, 0.8])),
                   frequency_penalty=data.draw(st.sampled_from([0.0, 0.4, -0.6])),
                   presence_penalty=data.draw(st.sampled_from([0.0, 0.5, -1.0])))
        requests.append(RequestSampling(prompt, output, temperature=0.0, **pen))
        sizes.append(data.draw(st.integers(1, 8)))
    req, parent, token = [], [], []
    for r, size in enumerate(sizes):
        base = len(req)
        for i in range(size):
            req.append(r)
            parent.append(-1 if i == 0 else base + data.draw(st.integers(0, i - 1)))
            token.append(requests[r].output_token_ids[-1] if i == 0 else data.draw(tok))
    tree = TreeBatch.from_parents(req, parent, token)
    values = st.one_of(st.floats(-30, 30, width=32), st.sampled_from([0.0, -0.0, float("-inf")]))
    logits = torch.tensor(data.draw(st.lists(values, min_size=tree.num_nodes * vocab,
                                             max_size=tree.num_nodes * vocab)),
                          dtype=torch.float32).view(tree.num_nodes, vocab)
    groups = group_by_request(tree, requests)
    got = logits.clone()
    apply_penalties_sparse(got, groups, tree.depth, tree.path_tokens())
    # vLLM, one row per node: prompt; output = request output + path (padded with vocab)
    path = tree.path_tokens()

    def padded(rows):
        width = max(len(r) for r in rows)
        return torch.tensor([[t if t >= 0 else vocab for t in r] + [vocab] * (width - len(r))
                             for r in rows])

    rs_of = [requests[int(r)] for r in tree.req]
    want = apply_penalties(
        logits.clone(), padded([list(rs.prompt_token_ids) for rs in rs_of]),
        padded([list(rs.output_token_ids) + path[n, :tree.depth[n]].tolist()
                for n, rs in enumerate(rs_of)]),
        torch.tensor([rs.presence_penalty for rs in rs_of], dtype=torch.float32),
        torch.tensor([rs.frequency_penalty for rs in rs_of], dtype=torch.float32),
        torch.tensor([rs.repetition_penalty for rs in rs_of], dtype=torch.float32))
    assert torch.equal(got, want)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_penalised_candidates_equal_vllms_apply_penalties_bit_for_bit(data):
    """penalise_candidates (the compiled kernel, with and without a kept TokenHistory) == vLLM's
    apply_penalties read at the candidates: prompt / output / path tokens with duplicates,
    async -1 placeholders, zero, negative and -inf logits, several requests with their own
    penalties, rows whose candidates repeat a token."""
    from dataclasses import replace

    from vllm.model_executor.layers.utils import apply_penalties

    from vllm_recap.vllm.token_history import TokenHistory
    from vllm_recap.vllm.tree_sampling import penalise_candidates

    vocab = data.draw(st.integers(4, 40))
    tok = st.integers(0, vocab - 1)
    requests = []
    for _ in range(data.draw(st.integers(1, 3))):
        prompt = data.draw(st.lists(tok, min_size=1, max_size=12))
        output = data.draw(st.lists(st.one_of(tok, st.just(-1)), min_size=1, max_size=10))
        pen = dict(repetition_penalty=data.draw(st.sampled_from([1.0, 1.05, 1.3, 0.8])),
                   frequency_penalty=data.draw(st.sampled_from([0.0, 0.4, -0.6])),
                   presence_penalty=data.draw(st.sampled_from([0.0, 0.5, -1.0])))
        rs = RequestSampling(prompt, output, temperature=0.0, **pen)
        if data.draw(st.booleans()):
            history = TokenHistory()
            history.sync(prompt, output)
            rs = replace(rs, history=history)
        requests.append(rs)
    m, k = data.draw(st.integers(1, 8)), data.draw(st.integers(1, vocab))
    owner = np.array(data.draw(st.lists(st.integers(0, len(requests) - 1), min_size=m,
                                        max_size=m)), np.int64)
    paths = [data.draw(st.lists(tok, max_size=4)) for _ in range(m)]
    values = st.one_of(st.floats(-30, 30, width=32), st.sampled_from([0.0, -0.0, float("-inf")]))
    logits = torch.tensor(data.draw(st.lists(values, min_size=m * vocab, max_size=m * vocab)),
                          dtype=torch.float32).view(m, vocab)
    ids = np.array([data.draw(st.lists(tok, min_size=k, max_size=k)) for _ in range(m)],
                   np.int64)
    got = penalise_candidates(logits.numpy()[np.arange(m)[:, None], ids], ids, owner, paths,
                              requests)

    def padded(rows):
        width = max(1, max(len(r) for r in rows))
        return torch.tensor([[t if t >= 0 else vocab for t in r] + [vocab] * (width - len(r))
                             for r in rows])

    rs_of = [requests[int(g)] for g in owner]
    want = apply_penalties(
        logits.clone(), padded([list(rs.prompt_token_ids) for rs in rs_of]),
        padded([list(rs.output_token_ids) + list(p) for rs, p in zip(rs_of, paths)]),
        torch.tensor([rs.presence_penalty for rs in rs_of], dtype=torch.float32),
        torch.tensor([rs.frequency_penalty for rs in rs_of], dtype=torch.float32),
        torch.tensor([rs.repetition_penalty for rs in rs_of], dtype=torch.float32))
    expected = want.numpy()[np.arange(m)[:, None], ids]
    assert np.array_equal(got.view(np.int32), expected.view(np.int32))  # bits: -0.0 too


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_ranked_candidates_equal_a_stable_sort(data):
    """rank_candidates == a stable numpy sort by value (ties keep their order), the lowest id
    among each row's maxima, the softmax over the ranked values, and "decided" exactly when
    every row's maximum is above its bound."""
    from vllm_recap.core.penalties import rank_candidates

    m, k = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 9))
    grid = st.sampled_from([-3.0, -0.5, 0.0, -0.0, 0.5, 1.0, 2.5, 4.0])
    v = np.array(data.draw(st.lists(grid, min_size=m * k, max_size=m * k)),
                 np.float32).reshape(m, k)
    ids = np.array([data.draw(st.permutations(range(20)))[:k] for _ in range(m)], np.int64)
    bound = np.array(data.draw(st.lists(grid, min_size=m, max_size=m)), np.float32)
    mem_ids, mem_vals, probs, argmax, decided = rank_candidates(v, ids, bound)
    order = np.argsort(-v, axis=1, kind="stable")
    assert np.array_equal(mem_ids, np.take_along_axis(ids, order, 1))
    assert np.array_equal(mem_vals, np.take_along_axis(v, order, 1))
    best = v.max(axis=1)
    assert argmax.tolist() == [int(ids[r][v[r] == best[r]].min()) for r in range(m)]
    assert decided == bool(np.all(best > bound))
    e = np.exp(mem_vals.astype(np.float64) - mem_vals[:, :1])
    np.testing.assert_allclose(probs, e / e.sum(1, keepdims=True), rtol=1e-6)
    assert rank_candidates(v, ids)[4]  # no bound: decided


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_values_are_the_logits_entries_exactly(dtype):
    """The compiled gather from the rows' bits (CPU bfloat16 / float32) reads exactly the
    entries torch indexing reads, negative values, zeros and -inf included."""
    from vllm_recap.vllm.verifier import rows_values

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 300, generator=g) * 20).to(dtype)
    logits[2, 5], logits[3, 7], logits[4, 9] = -0.0, float("-inf"), 0.0
    rows = np.array([2, 3, 4, 0, 6], np.int64)
    ids = np.array([[5, 0, 299], [7, 1, 2], [9, 9, 8], [3, 4, 5], [100, 200, 250]], np.int64)
    want = logits[torch.from_numpy(rows)[:, None], torch.from_numpy(ids)].float().numpy()
    got = rows_values(logits, rows, ids)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.int32), want.view(np.int32))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_penalised_top_argmax_equals_whole_row_processing_when_decided(data):
    """The argmax from each row's raw top K == the argmax of vLLM's processed row whenever the
    function calls it decided (ties included: logits from a coarse grid), and it is decided
    whenever the best penalised candidate stays above the K-th raw value."""
    from vllm_recap.vllm.tree_sampling import penalised_top_argmax, penalties_only
    from vllm_recap.vllm.tree_walk import greedy_sample

    vocab = data.draw(st.integers(4, 24))
    k = data.draw(st.integers(1, vocab - 1))
    tok = st.integers(0, vocab - 1)
    requests, sizes = [], []
    for _ in range(data.draw(st.integers(1, 3))):
        pen = dict(repetition_penalty=data.draw(st.sampled_from([1.0, 1.05, 1.5])),
                   frequency_penalty=data.draw(st.sampled_from([0.0, 0.5])),
                   presence_penalty=data.draw(st.sampled_from([0.0, 0.25])))
        requests.append(RequestSampling(data.draw(st.lists(tok, min_size=1, max_size=8)),
                                        data.draw(st.lists(tok, min_size=1, max_size=6)),
                                        temperature=0.0, **pen))
        sizes.append(data.draw(st.integers(1, 6)))
    assert all(penalties_only(r) for r in requests)
    tree = random_forest(np.random.default_rng(data.draw(st.integers(0, 99))), requests, sizes,
                         n_tokens=vocab)
    grid = st.sampled_from([-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    logits = torch.tensor(data.draw(st.lists(grid, min_size=tree.num_nodes * vocab,
                                             max_size=tree.num_nodes * vocab)),
                          dtype=torch.float32).view(tree.num_nodes, vocab)
    top = torch.sort(logits, dim=1, descending=True, stable=True)
    values, ids = top.values[:, :k].numpy(), top.indices[:, :k].numpy().astype(np.int64)
    path = tree.path_tokens()
    paths = [path[n, :tree.depth[n]].tolist() for n in range(tree.num_nodes)]
    argmax, mem_ids, probs = penalised_top_argmax(values, ids, tree.req, paths, requests)
    want = greedy_sample(process_tree_logits(logits, tree, requests))
    if argmax is not None:
        assert argmax.tolist() == want.tolist()
        assert mem_ids.shape == (tree.num_nodes, k)
        np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)
