"""Step layout, greedy tree acceptance in vLLM's layout, and KV compaction moves."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_recap.core.tree import DraftTree
from vllm_recap.vllm.context import StashedKV
from vllm_recap.vllm.layout import (as_scheduled, build_plan, chain_parents,
                                    next_prefill_tokens, whole_step_slots)
from tests.unit.fake_engine import greedy_params
from vllm_recap.vllm.tree_verify import prepare, write
from vllm_recap.vllm.driver import decode_context
from vllm_recap.vllm.verifier import compact_kv, node_tokens_of_rows, topk_rows

pytestmark = pytest.mark.unit

#        0(root)
#       /  |   \
#      1   2    3
#     /        / \
#    4        5   6
TREE = np.array([-1, 0, 0, 0, 1, 3, 3])


def _tree(tokens, parents) -> DraftTree:
    return DraftTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int64),
                     np.ones(len(tokens)))


def _plan(num_computed=(0, 30, 40), num_prompt=(9, 9, 9)):
    # batch: r0 prefill chunk of 5 tokens, r1 tree of 7 nodes, r2 chain of 3 nodes
    req_ids = ["r0", "r1", "r2"]
    num_sched = np.array([5, 7, 3])
    qsl = np.array([0, 5, 12, 15])
    proposals = {"r1": _tree([10, 11, 12, 13, 14, 15, 16], TREE),
                 "r2": _tree([20, 21, 22], chain_parents(3))}
    drafts = {r: t.draft_tokens.tolist() for r, t in proposals.items()}
    return build_plan(req_ids, num_sched, qsl, drafts, proposals, np.array(num_computed),
                      np.array(num_prompt))


def test_plan_layout():
    plan = _plan()
    assert plan.num_drafts.tolist() == [0, 6, 2]
    assert plan.logits_starts.tolist() == [0, 1, 8, 11]
    assert [t.batch_index for t in plan.trees] == [1]  # the chain needs no tree attention
    tree = plan.trees[0]
    assert tree.query_start == 5
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert tree.ancestor_mask[5].tolist() == [True, False, False, True, False, True, False]


def test_whole_step_slots_lay_chains_and_lone_roots_out_read_only():
    # every request a decode: r0 a lone root, r1 the tree, r2 a chain of 3
    plan = _plan(num_computed=(20, 30, 40))
    plan.num_scheduled[0] = 1
    plan.query_starts[:] = [0, 1, 8, 11]
    slots = whole_step_slots(plan)
    assert [s.batch_index for s in slots] == [0, 1, 2]
    assert slots[1] is plan.trees[0]
    root, chain = slots[0], slots[2]
    assert (root.query_start, root.parents.tolist(), root.depths.tolist()) == (0, [-1], [0])
    assert chain.parents.tolist() == [-1, 0, 1] and chain.depths.tolist() == [0, 1, 2]
    assert chain.ancestor_mask.tolist() == np.tri(3, dtype=bool).tolist()
    # the chain arrays are shared by every step: nobody may edit them in place
    for a in (root.parents, chain.parents, chain.depths, chain.ancestor_mask,
              chain_parents(3)):
        assert not a.flags.writeable
    assert whole_step_slots(plan)[2].parents is chain.parents


def _one(drafts, proposals):
    n = 1 + len(drafts)
    return build_plan(["r1"], np.array([n]), np.array([0, n]), {"r1": drafts}, proposals,
                      np.array([30]), np.array([9]))


def test_scheduled_drafts_are_matched_to_the_depth_first_subtree_sent():
    """The proposer sends the first b nodes of its tree depth first; the layout derives the
    same subtree from what was scheduled (every rank alike), whatever its own b was."""
    tree = _tree([10, 11, 12, 13, 14, 15, 16], TREE).best_first()
    sent = tree.truncate(5).depth_first()
    assert sent.tokens.tolist() != tree.tokens[:5].tolist()
    for laid in (sent, None, tree.truncate(3).depth_first()):  # own, none, another rank's
        got = as_scheduled(tree, laid, sent.draft_tokens.tolist())
        assert got.tokens.tolist() == sent.tokens.tolist()
        assert got.parents.tolist() == sent.parents.tolist()
    plan = _one(sent.draft_tokens.tolist(), {"r1": as_scheduled(tree, None, sent.draft_tokens)})
    assert plan.parents[0].tolist() == sent.parents.tolist()
    # drafts that are not that subtree (a cut inside its order) get the full tree back:
    # build_plan then verifies them as the prefix they are, or as a chain
    cut = sent.draft_tokens[:3].tolist()  # [11, 14, 12]: not the first 4 nodes depth first
    assert as_scheduled(tree, sent, cut) is tree
    assert _one(cut, {"r1": tree}).parents[0].tolist() == [-1, 0, 1, 2]  # verified as a chain
    assert as_scheduled(tree, sent, []) is tree


def test_truncated_drafts_keep_a_valid_prefix_tree():
    plan = _one([11, 12, 13], {"r1": _tree([10, 11, 12, 13, 14, 15, 16], TREE)})
    assert plan.parents[0].tolist() == [-1, 0, 0, 0]
    assert plan.trees[0].depths.tolist() == [0, 1, 1, 1]


def test_missing_record_means_chain():
    plan = _one([1, 2], {})
    assert plan.parents[0].tolist() == [-1, 0, 1] and plan.trees == []


def _logits_for(argmax_rows: list[int], vocab: int = 32) -> torch.Tensor:
    logits = torch.randn(len(argmax_rows), vocab)
    logits[torch.arange(len(argmax_rows)), torch.tensor(argmax_rows)] = 100.0
    return logits


def _runner(plan, params=None):
    """What tree verification reads from vLLM's runner: each request's sampling state."""
    from types import SimpleNamespace

    return SimpleNamespace(requests={r: SimpleNamespace(
        sampling_params=params or greedy_params(), prompt_token_ids=[1, 2, 3],
        output_token_ids=[7], generator=None) for r in plan.req_ids})


def _verify(plan, argmax_rows, sampled):
    node_tokens = np.array([7, 10, 11, 12, 13, 14, 15, 16, 20, 21, 22])
    logits = _logits_for(argmax_rows)
    ver = prepare(plan, logits, node_tokens, _runner(plan), keep_rows=False)
    out = SimpleNamespace(sampled_token_ids=sampled, logprobs_tensors=None)
    write(ver, plan, out, "raw_logprobs")
    return ver.accepted(plan)


def test_tree_acceptance_follows_argmax_and_writes_vllm_layout():
    plan = _plan()
    # node tokens per logits row: r0 [last prompt tok], r1 [root, 11..16], r2 [root, 21, 22]
    # r1: root -> 13 (node 3), node 3 -> 16 (node 6), node 6 -> bonus 30
    sampled = torch.full((3, 7), 99, dtype=torch.int32)  # what vLLM's sampler returned
    accepted = _verify(plan, [0, 13, 0, 0, 16, 0, 0, 30, 21, 22, 5], sampled)
    assert accepted[1].tolist() == [3, 6]
    assert sampled[1].tolist() == [13, 16, 30, -1, -1, -1, -1]
    assert sampled[0].tolist() == [99] * 7 and sampled[2].tolist() == [99] * 7  # untouched


def test_no_match_gives_bonus_only():
    sampled = torch.zeros((3, 7), dtype=torch.int32)
    accepted = _verify(_plan(), [0, 31, 0, 0, 0, 0, 0, 0, 0, 0, 0], sampled)
    assert accepted[1].tolist() == [] and sampled[1].tolist() == [31, -1, -1, -1, -1, -1, -1]


def test_penalised_trees_give_the_memories_rows_of_the_processed_distribution():
    """Under a repetition penalty the target picks from the penalised row; the memories get
    that row's top-K (their top-1 is the token the walk compares), not the raw row's, whose
    top-1 is a penalised token here. Plain greedy trees keep the raw rows (None)."""
    plan = _plan()
    node_tokens = np.array([7, 10, 11, 12, 13, 14, 15, 16, 20, 21, 22])
    logits = torch.randn(11, 32)
    logits[:, 7] = 10.0  # raw top-1 everywhere: 7, which the request's output holds
    logits[:, 9] = 8.0  # penalised: 10 / 1.5 < 8, so 9 wins
    runner = _runner(plan, greedy_params(repetition_penalty=1.5))
    top_ids, _ = topk_rows(logits, 4)
    # min_tokens sends the tree to whole rows (the root's, the only one its walk visits),
    # the others get their raw top K penalised
    for params in (greedy_params(repetition_penalty=1.5),
                   greedy_params(repetition_penalty=1.5, min_tokens=100, stop_token_ids=[5])):
        ver = prepare(plan, logits, node_tokens, _runner(plan, params), keep_rows=False,
                      top_k=4, top_ids=top_ids)
        flat, ids, probs = ver.memory_rows
        assert sorted(flat.tolist()) == list(range(1, 8))  # r1's tree rows
        assert (ids[:, 0] == 9).all() and (ids[:, 1] == 7).all()
        np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-6)
        assert ver.tokens == [[9]]
    plain = prepare(plan, logits, node_tokens, _runner(plan), keep_rows=False, top_k=4)
    assert plain.memory_rows is None


@pytest.mark.parametrize("seed", range(6))
def test_penalised_trees_decided_from_the_raw_top_k_equal_whole_row_processing(seed):
    """With the raw top-K ids (the driver's memory rows) penalised greedy trees are walked
    from those K candidates: the same acceptance and committed tokens as processing whole
    rows, and the same top-1 memory row; rows where a penalised candidate could lose to an
    entry outside the top K fall back to whole rows."""
    plan = _plan()
    node_tokens = np.array([7, 10, 11, 12, 13, 14, 15, 16, 20, 21, 22])
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(11, 32, generator=gen) * 2
    # the path and output tokens among the leaders, so the penalties move the argmax
    logits[:, [7, 11, 13, 14]] += torch.rand(11, 4, generator=gen) * 4
    logits[1, 13] += 20.0  # r1's root picks node 3 (token 13): the walk goes below the root
    params = greedy_params(repetition_penalty=1.3, frequency_penalty=0.3, presence_penalty=0.2)
    runner = _runner(plan, params)
    ids, _ = topk_rows(logits, 4)
    fast = prepare(plan, logits, node_tokens, runner, keep_rows=False, top_k=4, top_ids=ids)
    full = prepare(plan, logits, node_tokens, runner, keep_rows=False, top_k=4)
    assert full.walk is not None
    assert [a.tolist() for a in fast.nodes] == [a.tolist() for a in full.nodes]
    assert fast.tokens == full.tokens and fast.nodes[0].tolist()[:1] == [3]
    if fast.walk is None:  # decided from the top K: the processed rows' top-1 as memory
        top1 = dict(zip(fast.memory_rows[0].tolist(), fast.memory_rows[1][:, 0].tolist()))
        # the whole-row path processed the rows its walk visited
        assert [top1[r] for r in full.memory_rows[0].tolist()] == full.memory_rows[1][:, 0].tolist()


def test_penalised_trees_undecided_in_the_top_k_fall_back_to_whole_rows():
    plan = _plan()
    node_tokens = np.array([7, 10, 11, 12, 13, 14, 15, 16, 20, 21, 22])
    logits = torch.zeros(11, 32)
    logits[:, 7] = 10.0  # the only candidate (K = 1), penalised below 9.0
    logits[:, 9] = 9.0
    runner = _runner(plan, greedy_params(repetition_penalty=1.5))
    ids, _ = topk_rows(logits, 1)
    ver = prepare(plan, logits, node_tokens, runner, keep_rows=False, top_k=1, top_ids=ids)
    assert ver.walk is not None  # whole rows processed (the root's: no child drafts 9)
    assert ver.tokens == [[9]] and ver.walk.target.tolist()[0] == 9


class _FakeImpl:
    """Records what each cache write stores: the rows whose slot is not vLLM's padding -1
    (every CPU kernel's cache write skips those)."""

    def __init__(self):
        self.calls = []

    def do_kv_cache_update(self, layer, k, v, kv_cache, slots):
        keep = slots >= 0
        self.calls.append((layer, k[keep].clone(), v[keep].clone(), slots[keep].clone()))


def _stash(impl, layer, k, v, slots, batch_index=1) -> StashedKV:
    return StashedKV(impl, layer, None, batch_index, k, v, slots)


def test_compaction_moves_only_off_chain_nodes_in_depth_order():
    impl = _FakeImpl()
    k = torch.arange(7, dtype=torch.float32)[:, None, None].expand(7, 1, 2)
    slots = torch.arange(100, 107)
    stash = [_stash(impl, layer, k, -k, slots) for layer in ("L0", "L1")]
    n = compact_kv(stash, {1: np.array([3, 6])})
    assert n == 2
    for layer, kk, vv, ss in impl.calls:
        assert kk[:, 0, 0].tolist() == [3.0, 6.0]  # sources: node 3 and node 6
        assert ss.tolist() == [101, 102]  # destinations: slots of depth 1 and 2
        assert torch.equal(vv, -kk)


def test_compaction_reads_a_stash_of_whole_layer_tensors_at_the_request_start():
    """Eager steps stash each layer's whole K/V and slot mapping with the request's first
    row (no slicing per layer): sources and destinations are offset by it."""
    impl = _FakeImpl()
    k = torch.arange(12, dtype=torch.float32)[:, None, None].expand(12, 1, 2)
    slots = torch.arange(200, 212)  # rows 0..4: another request; 5..11: this tree's nodes
    stash = [StashedKV(impl, layer, None, 1, k, -k, slots, start=5) for layer in ("L0", "L1")]
    assert compact_kv(stash, {1: np.array([3, 6])}) == 2
    for layer, kk, vv, ss in impl.calls:
        assert kk[:, 0, 0].tolist() == [8.0, 11.0]  # nodes 3 and 6 of the tree
        assert ss.tolist() == [206, 207]  # the slots of depth 1 and 2
        assert torch.equal(vv, -kk)


@pytest.mark.parametrize("views", [True, False])
def test_compaction_writes_the_cache_as_writing_each_moved_row_does(views):
    """vLLM's own CPU cache write, on a real paged cache: compaction of two requests' trees in
    two layers leaves every layer's cache as writing each moved node's K/V to its depth's
    slot would, and nothing else -- eager steps stash each layer's whole K/V (``views``),
    others a copy of each request's rows."""
    from types import SimpleNamespace

    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_recap.vllm.cpu_backend import RecapCPUAttentionImpl

    kvh, d, bs = 2, 32, 32
    fake = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32),
                           parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    with set_current_vllm_config(fake):
        impl = RecapCPUAttentionImpl(num_heads=4, head_size=d, scale=d ** -0.5, num_kv_heads=kvh,
                                     alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    layer = SimpleNamespace(isa=_get_attn_isa(torch.float32, bs, d, "auto"), _k_scale_float=1.0,
                            _v_scale_float=1.0)
    g = torch.Generator().manual_seed(0)
    # rows 0..2: a plain decode; 3..9: request 1's tree (7 nodes); 10..14: request 2's (5)
    starts = {1: 3, 2: 10}
    slots = torch.cat([torch.arange(3), 64 + torch.arange(7), 96 + torch.arange(5)])
    accepted = {1: np.array([2, 5]), 2: np.array([1, 4])}  # request 2: node 1 in place
    moved = {1: [(2, 1), (5, 2)], 2: [(4, 2)]}  # (node, depth) pairs that must move
    caches, stash, want = [], [], []
    for _ in range(2):  # layers
        key, value = torch.randn(16, kvh, d, generator=g), torch.randn(16, kvh, d, generator=g)
        cache = torch.randn(4, kvh, bs, 2 * d, generator=g)
        expected = cache.clone()
        for r, pairs in moved.items():
            for node, depth in pairs:
                row, slot = starts[r] + node, slots[starts[r] + depth].reshape(1)
                impl.do_kv_cache_update(layer, key[row:row + 1], value[row:row + 1], expected,
                                        slot)
        for r, start in starts.items():
            n = 7 if r == 1 else 5
            stash.append(StashedKV(impl, layer, cache, r, key, value, slots, start) if views
                         else StashedKV(impl, layer, cache, r, key[start:start + n].clone(),
                                        value[start:start + n].clone(),
                                        slots[start:start + n].clone()))
        caches.append(cache)
        want.append(expected)
    assert compact_kv(stash, accepted) == 4  # (request, layer) pairs that moved a node
    for cache, expected in zip(caches, want):
        assert torch.equal(cache, expected)


def test_compaction_skips_acceptance_already_in_place():
    impl = _FakeImpl()  # node 1 sits at depth 1: accepting it alone needs no copy
    stash = [_stash(impl, "L0", torch.zeros(7, 1, 2), torch.zeros(7, 1, 2), torch.arange(7))]
    assert compact_kv(stash, {1: np.array([1])}) == 0 and impl.calls == []


def test_next_prefill_tokens_counts_what_is_left_of_chunked_prompts():
    # a: decoding; b: 300 of a 1000-token prompt done, 256 scheduled now; c: last chunk now
    def plan(computed):
        return build_plan(["a", "b", "c"], np.array([1, 256, 40]), np.array([0, 1, 257, 297]),
                          {}, {}, np.array(computed), np.array([20, 1000, 100]))

    assert next_prefill_tokens(plan([50, 300, 60])) == 296  # b: 444 left; capped at 256 + 40
    assert next_prefill_tokens(plan([50, 700, 60])) == 44  # b's last chunk: 1000 - 700 - 256
    assert next_prefill_tokens(plan([50, 1000, 100])) == 0  # decodes only
    # the budget's context key: the mean KV length of the decoding requests only
    assert decode_context(plan([50, 300, 60])) == 50.0
    assert decode_context(plan([50, 1000, 100])) == (50 + 1000 + 100) / 3
    assert decode_context(plan([10, 300, 60])) == 0.0  # no request decoding


def test_topk_rows_ids_by_logit_and_softmax_over_the_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    ids, probs = topk_rows(logits, 3)
    assert ids.dtype == np.int64 and probs.dtype == np.float32
    assert ids.tolist() == [[1, 3, 2], [0, 1, 2]]
    e = np.exp(np.array([3.0, 2.0, 1.0]))
    np.testing.assert_allclose(probs[0], e / e.sum(), rtol=1e-6)
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-6)
    bf16_ids, bf16_probs = topk_rows(logits.bfloat16(), 3)  # model-dtype logits work too
    assert bf16_ids.tolist() == ids.tolist() and bf16_probs.dtype == np.float32


def test_node_tokens_are_the_last_one_plus_drafts_scheduled_tokens():
    plan = _plan()
    # flat batch: r0 prefill [1..5], r1 root + 6 drafts, r2 root + 2 drafts
    input_ids = np.array([1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15, 16, 20, 21, 22, 0, 0], np.int32)
    assert node_tokens_of_rows(plan, input_ids).tolist() == [5, 10, 11, 12, 13, 14, 15, 16,
                                                             20, 21, 22]


@pytest.mark.parametrize("vocab", [40000, 49152, 262144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_wide_rows_top_k_and_argmax_are_exact(vocab, dtype):
    """Wide rows are reduced chunk by chunk (speed; half precision over the bits as int16);
    the result must be torch's own: rows of negative logits and -0.0 next to +0.0 included."""
    from vllm_recap.vllm.verifier import row_argmax

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g).to(dtype)
    logits[1, [7, vocab - 1, 500]] = 50.0  # a tie at the maximum, one in the last chunk
    logits[2, -3:] = 40.0  # the top-3 in the partial last chunk (40000 = 312 x 128 + 64)
    logits[3] = -logits[3].abs() - 3.0  # every logit negative (bit patterns order reversed)
    logits[3, 9000] = -0.5
    logits[4] = -logits[4].abs() - 1.0
    logits[4, 3], logits[4, 9000] = -0.0, 0.0  # equal maxima: the lower id, as vLLM's argmax
    ids, probs = topk_rows(logits, 8)
    values, want = torch.topk(logits, 8, dim=-1)
    np.testing.assert_array_equal(np.take_along_axis(logits.float().numpy(), ids, 1),
                                  values.float().numpy())
    assert set(ids[2, :3]) == set(range(vocab - 3, vocab))
    np.testing.assert_array_equal(row_argmax(logits), logits.float().argmax(-1).numpy())
    assert row_argmax(logits)[1] == 7  # the lowest id among equal maxima, as vLLM's greedy
    assert row_argmax(logits)[3] == 9000 and ids[3, 0] == 9000
    assert row_argmax(logits)[4] == 3


def test_plain_greedy_walk_matches_the_vectorised_walk_on_random_forests():
    """Plain greedy trees are walked one by one in Python (cheaper per step); every other
    request goes through the vectorised walk. Both must accept the same nodes and commit the
    same token, duplicate sibling tokens included (the lowest index is followed)."""
    from vllm_recap.vllm.tree_sampling import TreeBatch
    from vllm_recap.vllm.tree_verify import _walk_plain
    from vllm_recap.vllm.tree_walk import walk_targets

    rng = np.random.default_rng(0)
    for _ in range(300):
        sizes = rng.integers(3, 12, size=rng.integers(1, 4))
        parents = [np.r_[-1, [rng.integers(0, i) for i in range(1, n)]] for n in sizes]
        tokens = rng.integers(0, 3, size=int(sizes.sum()))  # few ids: many duplicates
        targets = rng.integers(0, 3, size=int(sizes.sum()))
        starts = np.r_[0, np.cumsum(sizes)]
        plan = SimpleNamespace(verified=[SimpleNamespace(num_nodes=int(n), parents=p)
                                      for n, p in zip(sizes, parents)])
        batch = TreeBatch.from_parents(
            np.repeat(np.arange(len(sizes)), sizes),
            np.concatenate([np.where(p >= 0, p + s, -1) for p, s in zip(parents, starts)]),
            tokens)
        walk = walk_targets(batch, targets)
        ours = _walk_plain(plan, tokens, targets)
        assert ours.tokens == walk.output_tokens(batch)
        assert [a.tolist() for a in ours.nodes] == [
            (a - s).tolist() for a, s in zip(walk.accepted, starts)]
