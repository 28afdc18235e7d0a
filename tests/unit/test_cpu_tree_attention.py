"""The CPU tree-attention backend on a real paged KV cache, against dense references.

A batch mixes a prefill, a decode chain and a tree request, as an engine step does. Outputs
are poisoned with NaN first, so any row the backend forgets to write fails.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.reference_attention import dense_attention, tree_reference, visible
from vllm_recap.core.tree import DraftTree
from vllm_recap.vllm.attention_math import tree_attention
from vllm_recap.vllm.context import StepContext, StepScope
from vllm_recap.vllm.layout import build_plan, chain_parents

pytestmark = pytest.mark.unit

H, KVH, D, BS = 4, 2, 32, 32
TREE = np.array([-1, 0, 0, 0, 1, 3, 3, 4, 4])
# (name, prefix length, parents of the scheduled tokens or None for a causal chunk, blocks)
REQUESTS = [("prefill", 0, 20, None, [4]), ("chain", 40, 3, chain_parents(3), [0, 1]),
            ("tree", 50, len(TREE), TREE, [2, 3])]


@pytest.fixture(scope="module")
def impl_and_ops():
    from vllm import _custom_ops as ops
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_recap.vllm.cpu_backend import RecapCPUAttentionImpl

    fake = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32),
                           parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    with set_current_vllm_config(fake):
        impl = RecapCPUAttentionImpl(num_heads=H, head_size=D, scale=D ** -0.5, num_kv_heads=KVH,
                                     alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    isa = _get_attn_isa(torch.float32, BS, D, "auto")
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    return impl, layer, ops, isa


def _run(impl_and_ops, seed):
    impl, layer, ops, isa = impl_and_ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    g = torch.Generator().manual_seed(seed)
    kv_cache = torch.zeros(6, KVH, BS, 2 * D)
    seqs = []  # per request: full K, V [prefix + n]
    q_all, k_all, v_all, slots_all, block_rows = [], [], [], [], []
    for _name, prefix, n, _parents, blocks in REQUESTS:
        k = torch.randn(prefix + n, KVH, D, generator=g)
        v = torch.randn(prefix + n, KVH, D, generator=g)
        seqs.append((k, v))
        slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(prefix + n)])
        impl.do_kv_cache_update(layer, k[:prefix], v[:prefix], kv_cache, slots[:prefix])
        q_all.append(torch.randn(n, H, D, generator=g))
        k_all.append(k[prefix:])
        v_all.append(v[prefix:])
        slots_all.append(slots[prefix:])
        block_rows.append(blocks + [0] * (2 - len(blocks)))
    query, key, value = torch.cat(q_all), torch.cat(k_all), torch.cat(v_all)
    slot_mapping = torch.cat(slots_all)
    impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)  # as vLLM does pre-forward
    n_tok = [r[2] for r in REQUESTS]
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(n_tok)]), dtype=torch.int32)
    seq_lens = torch.tensor([r[1] + r[2] for r in REQUESTS], dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(REQUESTS), num_heads=H, num_kv_heads=KVH, head_dim=D, seq_lens=seq_lens,
        dtype=torch.float32, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False)
    meta = CPUAttentionMetadata(
        num_actual_tokens=int(qsl[-1]), max_query_len=max(n_tok), query_start_loc=qsl,
        max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
        block_table=torch.tensor(block_rows, dtype=torch.int32), slot_mapping=slot_mapping,
        scheduler_metadata=sched)
    trees = {r[0]: DraftTree(np.zeros(r[2], np.int64), np.asarray(r[3]), np.ones(r[2]))
             for r in REQUESTS if r[3] is not None}
    drafts = {name: t.draft_tokens.tolist() for name, t in trees.items()}
    plan = build_plan([r[0] for r in REQUESTS], np.array(n_tok), qsl.numpy(), drafts, trees,
                      np.array([r[1] for r in REQUESTS]), np.array([1, 1, 1]))
    output = torch.full((int(qsl[-1]), H, D), float("nan"))
    scope, ctx = StepScope(), StepContext(plan)
    impl.bind_step_scope(scope)
    scope.install(ctx)
    impl.forward(layer, query, key, value, kv_cache, meta, output)
    return ctx, seqs, q_all, output.view(-1, H, D), qsl


@pytest.mark.parametrize("seed", [0, 1])
def test_masked_attention_matches_dense_reference(impl_and_ops, seed):
    ctx, seqs, q_all, out, qsl = _run(impl_and_ops, seed)
    assert not torch.isnan(out).any(), "a row was left unwritten"
    for r, (_name, prefix, n, parents, _blocks) in enumerate(REQUESTS):
        k, v = seqs[r]
        # a prefill chunk and a chain are causal: a chain's parent array
        path_parents = chain_parents(n) if parents is None else parents
        expected = tree_reference(q_all[r], k, v, path_parents, prefix, D ** -0.5)
        got = out[int(qsl[r]):int(qsl[r + 1])]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the tree request's K/V were stashed for KV compaction, one entry per layer call
    assert [e.batch_index for e in ctx.kv_stash] == [2]


def test_tree_attention_equals_chain_attention_over_ancestors(impl_and_ops):
    """Row i of a tree equals plain causal attention over prefix + the path root..i."""
    _ctx, seqs, q_all, out, qsl = _run(impl_and_ops, 7)
    r = 2
    _name, prefix, n, parents, _ = REQUESTS[r]
    k, v = seqs[r]
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = int(parents[j])
        path = path[::-1]
        idx = torch.tensor(list(range(prefix)) + [prefix + p for p in path])
        causal = torch.ones(1, len(idx), dtype=torch.bool)  # the last query sees everything
        chain = dense_attention(q_all[r][i:i + 1], k[idx], v[idx], causal, D ** -0.5)
        torch.testing.assert_close(out[int(qsl[r]) + i], chain[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(4, 0.0), (2, 0.0), (6, 20.0)])
def test_sliding_window_and_softcap_match_the_reference(window, softcap):
    g = torch.Generator().manual_seed(3)
    n, p = 5, 10
    parents = np.array([-1, 0, 0, 1, 3])
    q = torch.randn(n, H, D, generator=g)
    k, v = torch.randn(p + n, KVH, D, generator=g), torch.randn(p + n, KVH, D, generator=g)
    tree = DraftTree(np.zeros(n, np.int64), parents, np.ones(n))
    mask = torch.from_numpy(build_plan(["r"], np.array([n]), np.array([0, n]),
                                       {"r": [0] * (n - 1)}, {"r": tree}, np.array([p]),
                                       np.array([1])).trees[0].ancestor_mask)
    pos = torch.from_numpy(tree.depths) + p
    out = tree_attention(q, k[:p], v[:p], k[p:], v[p:], mask, D ** -0.5, node_positions=pos,
                         sliding_window=window, softcap=softcap)
    expected = tree_reference(q, k, v, parents, p, D ** -0.5, window, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # the reference's window hides old prefix keys from the deepest node (not a no-op)
    assert not visible(list(parents), p, window)[-1, :p].all()
