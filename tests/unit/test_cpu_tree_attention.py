"""The CPU tree-attention backend on a real paged KV cache, against dense references.

A batch mixes a prefill, a decode chain and a tree request, as an engine step does. Outputs
are poisoned with NaN first, so any row the backend forgets to write fails.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_recap.core.tree import tree_structure
from vllm_recap.vllm import step as step_mod
from vllm_recap.vllm.step import build_plan, chain_parents
from vllm_recap.vllm.tree_attention import tree_attention

pytestmark = pytest.mark.unit

H, KVH, D, BS = 4, 2, 32, 32
TREE = np.array([-1, 0, 0, 0, 1, 3, 3, 4, 4])
# (name, prefix length, parents of the scheduled tokens or None for a causal chunk, blocks)
REQUESTS = [("prefill", 0, 20, None, [4]), ("chain", 40, 3, chain_parents(3), [0, 1]),
            ("tree", 50, len(TREE), TREE, [2, 3])]


def _dense(q, keys, values, allowed, scale):
    """[n, H, D] softmax attention of q over keys [S, KVH, D] where allowed [n, S]."""
    g = H // KVH
    k = keys.repeat_interleave(g, dim=1)  # [S, H, D]
    v = values.repeat_interleave(g, dim=1)
    scores = torch.einsum("nhd,shd->hns", q.double(), k.double()) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hns,shd->nhd", torch.softmax(scores, -1), v.double()).float()


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
    drafts = {r[0]: [0] * (r[2] - 1) for r in REQUESTS if r[3] is not None}
    parents = {r[0]: r[3] for r in REQUESTS if r[3] is not None}
    plan = build_plan([r[0] for r in REQUESTS], np.array(n_tok), qsl.numpy(), drafts, parents)
    output = torch.full((int(qsl[-1]), H, D), float("nan"))
    step_mod.CURRENT = plan
    try:
        impl.forward(layer, query, key, value, kv_cache, meta, output)
    finally:
        step_mod.CURRENT = None
    return plan, seqs, q_all, output.view(-1, H, D), qsl


@pytest.mark.parametrize("seed", [0, 1])
def test_masked_attention_matches_dense_reference(impl_and_ops, seed):
    plan, seqs, q_all, out, qsl = _run(impl_and_ops, seed)
    assert not torch.isnan(out).any(), "a row was left unwritten"
    scale = D ** -0.5
    for r, (name, prefix, n, parents, _blocks) in enumerate(REQUESTS):
        k, v = seqs[r]
        allowed = torch.zeros(n, prefix + n, dtype=torch.bool)
        allowed[:, :prefix] = True
        if parents is None or name == "chain":
            allowed[:, prefix:] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        else:
            allowed[:, prefix:] = torch.from_numpy(tree_structure(parents)[2])
        expected = _dense(q_all[r], k, v, allowed, scale)
        got = out[int(qsl[r]):int(qsl[r + 1])]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # the tree request's K/V were stashed for KV compaction, one entry per layer call
    assert [e[3] for e in plan.kv_stash] == [2]


def test_tree_attention_equals_chain_attention_over_ancestors(impl_and_ops):
    """Row i of a tree equals plain causal attention over prefix + the path root..i."""
    _plan, seqs, q_all, out, qsl = _run(impl_and_ops, 7)
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
        chain = tree_attention(q_all[r][i:i + 1], k[idx[:-1]], v[idx[:-1]], k[idx[-1:]],
                               v[idx[-1:]], torch.ones(1, 1, dtype=torch.bool), D ** -0.5)
        torch.testing.assert_close(out[int(qsl[r]) + i], chain[0], rtol=1e-5, atol=1e-5)


def test_sliding_window_masks_old_prefix_keys():
    g = torch.Generator().manual_seed(3)
    n, p, window = 3, 10, 4
    q = torch.randn(n, H, D, generator=g)
    kp, vp = torch.randn(p, KVH, D, generator=g), torch.randn(p, KVH, D, generator=g)
    kt, vt = torch.randn(n, KVH, D, generator=g), torch.randn(n, KVH, D, generator=g)
    parents = np.array([-1, 0, 0])
    mask = torch.from_numpy(tree_structure(parents)[2])
    pos = torch.tensor([p, p + 1, p + 1])
    out = tree_attention(q, kp, vp, kt, vt, mask, D ** -0.5, node_positions=pos,
                         sliding_window=window)
    keys, values = torch.cat([kp, kt]), torch.cat([vp, vt])
    key_pos = torch.cat([torch.arange(p), pos])
    allowed = torch.ones(n, p + n, dtype=torch.bool)
    allowed[:, p:] = mask
    allowed &= key_pos[None] > pos[:, None] - window
    torch.testing.assert_close(out, _dense(q, keys, values, allowed, D ** -0.5), rtol=1e-5, atol=1e-5)
