"""Step layout, greedy tree acceptance in vLLM's layout, and KV compaction moves."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_recap.vllm.step import build_plan, chain_parents
from vllm_recap.vllm.verifier import accept_trees, compact_kv, tree_argmax

pytestmark = pytest.mark.unit

#        0(root)
#       /  |   \
#      1   2    3
#     /        / \
#    4        5   6
TREE = np.array([-1, 0, 0, 0, 1, 3, 3])


def _plan():
    # batch: r0 prefill chunk of 5 tokens, r1 tree of 7 nodes, r2 chain of 3 nodes
    req_ids = ["r0", "r1", "r2"]
    num_sched = np.array([5, 7, 3])
    qsl = np.array([0, 5, 12, 15])
    drafts = {"r1": [11, 12, 13, 14, 15, 16], "r2": [21, 22]}
    parents = {"r1": TREE, "r2": chain_parents(3)}
    return build_plan(req_ids, num_sched, qsl, drafts, parents)


def test_plan_layout():
    plan = _plan()
    assert plan.num_drafts.tolist() == [0, 6, 2]
    assert plan.logits_starts.tolist() == [0, 1, 8, 11]
    assert [t.batch_index for t in plan.trees] == [1]  # the chain needs no tree attention
    tree = plan.trees[0]
    assert tree.query_start == 5
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert tree.ancestor_mask[5].tolist() == [True, False, False, True, False, True, False]


def test_truncated_drafts_keep_a_valid_prefix_tree():
    plan = build_plan(["r1"], np.array([4]), np.array([0, 4]), {"r1": [11, 12, 13]}, {"r1": TREE})
    assert plan.parents[0].tolist() == [-1, 0, 0, 0]


def test_missing_record_means_chain():
    plan = build_plan(["r"], np.array([3]), np.array([0, 3]), {"r": [1, 2]}, {})
    assert plan.parents[0].tolist() == [-1, 0, 1] and plan.trees == []


def _logits_for(argmax_rows: list[int], vocab: int = 32) -> torch.Tensor:
    logits = torch.randn(len(argmax_rows), vocab)
    logits[torch.arange(len(argmax_rows)), torch.tensor(argmax_rows)] = 100.0
    return logits


def test_tree_acceptance_follows_argmax_and_writes_vllm_layout():
    plan = _plan()
    # node tokens per logits row: r0 [last prompt tok], r1 [root, 11..16], r2 [root, 21, 22]
    node_tokens = np.array([7, 10, 11, 12, 13, 14, 15, 16, 20, 21, 22])
    # r1: root -> 13 (node 3), node 3 -> 16 (node 6), node 6 -> bonus 30
    argmax = [0, 13, 0, 0, 16, 0, 0, 30, 21, 22, 5]
    logits = _logits_for(argmax)
    sampled = torch.full((3, 7), 99, dtype=torch.int32)  # what vLLM's sampler returned
    accepted = accept_trees(plan, tree_argmax(plan, logits), node_tokens, sampled)
    assert accepted[1].tolist() == [3, 6]
    assert sampled[1].tolist() == [13, 16, 30, -1, -1, -1, -1]
    assert sampled[0].tolist() == [99] * 7 and sampled[2].tolist() == [99] * 7  # untouched


def test_no_match_gives_bonus_only():
    plan = _plan()
    node_tokens = np.array([7, 10, 11, 12, 13, 14, 15, 16, 20, 21, 22])
    logits = _logits_for([0, 31, 0, 0, 0, 0, 0, 0, 0, 0, 0])
    sampled = torch.zeros((3, 7), dtype=torch.int32)
    accepted = accept_trees(plan, tree_argmax(plan, logits), node_tokens, sampled)
    assert accepted[1].tolist() == [] and sampled[1].tolist() == [31, -1, -1, -1, -1, -1, -1]


class _FakeImpl:
    def __init__(self):
        self.calls = []

    def do_kv_cache_update(self, layer, k, v, kv_cache, slots):
        self.calls.append((layer, k.clone(), v.clone(), slots.clone()))


def test_compaction_moves_only_off_chain_nodes_in_depth_order():
    plan = _plan()
    impl = _FakeImpl()
    k = torch.arange(7, dtype=torch.float32)[:, None, None].expand(7, 1, 2)
    slots = torch.arange(100, 107)
    for layer in ("L0", "L1"):
        plan.kv_stash.append((impl, layer, None, 1, k, -k, slots))
    n = compact_kv(plan, {1: np.array([3, 6])})
    assert n == 2
    for layer, kk, vv, ss in impl.calls:
        assert kk[:, 0, 0].tolist() == [3.0, 6.0]  # sources: node 3 and node 6
        assert ss.tolist() == [101, 102]  # destinations: slots of depth 1 and 2
        assert torch.equal(vv, -kk)


def test_compaction_skips_acceptance_already_in_place():
    plan = _plan()  # node 1 sits at depth 1: accepting it alone needs no copy
    impl = _FakeImpl()
    plan.kv_stash.append((impl, "L0", None, 1, torch.zeros(7, 1, 2), torch.zeros(7, 1, 2),
                          torch.arange(7)))
    assert compact_kv(plan, {1: np.array([1])}) == 0 and impl.calls == []


def test_next_prefill_tokens_counts_what_is_left_of_chunked_prompts():
    from vllm_recap.vllm.proposer import next_prefill_tokens

    # a: decoding; b: 300 of a 1000-token prompt done, 256 scheduled now; c: last chunk now
    plan = build_plan(["a", "b", "c"], np.array([1, 256, 40]), np.array([0, 1, 257, 297]), {}, {})
    plan.num_computed = np.array([50, 300, 60])
    plan.num_prompt = np.array([20, 1000, 100])
    assert next_prefill_tokens(plan) == 296  # b has 444 left; capped at this step's 256 + 40
    plan.num_computed = np.array([50, 700, 60])
    assert next_prefill_tokens(plan) == 44  # b's last chunk: 1000 - 700 - 256
    plan.num_computed = None  # no prompt bookkeeping: assume decodes only
    assert next_prefill_tokens(plan) == 0
