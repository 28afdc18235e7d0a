"""Tree attention as root-to-leaf paths inside vLLM's CPU kernel, on a real paged cache.

Each batch mixes a prefill chunk, a decode, a chain and bushy trees whose prefixes end
mid-block, exactly at a block end and just before one (so paths straddle blocks), as an engine
step does. Real block ids are shuffled and scratch ids are a reserved run (one test scatters
them); unused cache slots hold large random values (a wrong block or slot shows up) and
outputs are poisoned with NaN first (a forgotten row shows up). The oracle is the float64
reference in ``tests/reference_attention.py``; the old CPU path (stock kernel + dense
recompute) must agree too.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reference_attention import tree_reference
from vllm_recap.core.tree import DraftTree
from vllm_recap.vllm.context import StepContext, StepScope
from vllm_recap.vllm.cpu_paths import (
    VirtualBatch,
    forward_with_paths,
    scratch_blocks_needed,
    split_paths,
    step_virtual_batch,
)
from vllm_recap.vllm.layout import build_plan, chain_parents

pytestmark = pytest.mark.unit

H, KVH = 4, 2
TREE_A = [-1, 0, 1, 2, 0, 0, 4, 1, 7, 5, 2, 9]  # chain 0..3, then siblings and cousins
TREE_B = [-1, 0, 1, 0, 1, 3, 3, 2, 5, 5]
TREE_C = [-1, 0, 1, 2, 3, 0, 5, 6, 7, 1, 9, 10]  # deep side paths (straddle a block end)


def _requests(bs: int):
    """(name, prefix, scheduled tokens, parents or None for a causal run)."""
    return [("prefill", bs + 5, 20, None), ("decode", bs - 1, 1, None),
            ("chain", 2 * bs, 4, chain_parents(4)), ("tree_mid", bs + 9, len(TREE_A), TREE_A),
            ("tree_end", 2 * bs, len(TREE_B), TREE_B),
            ("tree_straddle", 2 * bs - 3, len(TREE_C), TREE_C)]


def _impl(head_size, window=None, softcap=None, dtype=torch.float32):
    from vllm.config import set_current_vllm_config

    from vllm_recap.vllm.cpu_backend import RecapCPUAttentionImpl

    fake = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype),
                           parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    with set_current_vllm_config(fake):
        return RecapCPUAttentionImpl(
            num_heads=H, head_size=head_size, scale=head_size ** -0.5, num_kv_heads=KVH,
            alibi_slopes=None, sliding_window=window, kv_cache_dtype="auto",
            logits_soft_cap=softcap)


def _batch(requests, bs, hs, dtype, window=None, softcap=None, seed=0, spare=40):
    """A step as vLLM hands it to the attention layer (K/V already in their real slots)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, _get_attn_isa

    impl = _impl(hs, window, softcap, dtype)
    isa = _get_attn_isa(dtype, bs, hs, "auto")
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    g = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // bs) for _, p, n, _ in requests]
    pool = torch.randperm(sum(need), generator=g).tolist()  # real blocks in shuffled order
    scratch = list(range(sum(need), sum(need) + spare))  # a reserved run, as recommended
    kv_cache = (torch.randn(sum(need) + spare, KVH, bs, 2 * hs, generator=g) * 8).to(dtype)
    width = max(need)
    seqs, qs, toks, slots_all, rows = [], [], [], [], []
    for (_, prefix, n, _), nb in zip(requests, need):
        blocks, pool = pool[:nb], pool[nb:]
        k = torch.randn(prefix + n, KVH, hs, generator=g).to(dtype)
        v = torch.randn(prefix + n, KVH, hs, generator=g).to(dtype)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(prefix + n)])
        impl.do_kv_cache_update(layer, k[:prefix], v[:prefix], kv_cache, slots[:prefix])
        seqs.append((k, v))
        qs.append(torch.randn(n, H, hs, generator=g).to(dtype))
        toks.append((k[prefix:], v[prefix:]))
        slots_all.append(slots[prefix:])
        rows.append(blocks + [0] * (width - nb))
    key = torch.cat([t[0] for t in toks])
    value = torch.cat([t[1] for t in toks])
    slot_mapping = torch.cat(slots_all)
    impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
    n_tok = [r[2] for r in requests]
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(n_tok)]), dtype=torch.int32)
    seq_lens = torch.tensor([r[1] + r[2] for r in requests], dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(requests), num_heads=H, num_kv_heads=KVH, head_dim=hs, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=qsl, causal=True,
        sliding_window_size=-1 if window is None else window, isa=isa, enable_kv_split=True)
    meta = CPUAttentionMetadata(
        num_actual_tokens=int(qsl[-1]), max_query_len=max(n_tok), query_start_loc=qsl,
        max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
        block_table=torch.tensor(rows, dtype=torch.int32), slot_mapping=slot_mapping,
        scheduler_metadata=sched)
    names = [r[0] for r in requests]
    trees = {r[0]: DraftTree(np.zeros(r[2], np.int64), np.asarray(r[3]), np.ones(r[2]))
             for r in requests if r[3] is not None}
    plan = build_plan(names, np.array(n_tok), qsl.numpy(),
                      {name: t.draft_tokens.tolist() for name, t in trees.items()}, trees,
                      np.array([r[1] for r in requests]), np.ones(len(requests), np.int64))
    return SimpleNamespace(impl=impl, layer=layer, kv_cache=kv_cache, meta=meta, plan=plan,
                           query=torch.cat(qs), key=key, value=value, qs=qs, seqs=seqs,
                           requests=requests, qsl=qsl, free=scratch, bs=bs, hs=hs)


def _run_paths(b, scratch=None, kv_views=False):
    ctx = StepContext(b.plan, kv_views=kv_views)
    vb = VirtualBatch.build(b.plan, b.meta, b.bs, b.free if scratch is None else scratch)
    out = torch.full((b.query.shape[0], H * b.hs), float("nan"), dtype=b.query.dtype)
    forward_with_paths(b.impl, b.layer, b.query, b.key, b.value, b.kv_cache, b.meta, vb, out,
                       ctx)
    return out.view(-1, H, b.hs), ctx, vb


def _run_old(b):
    ctx, scope = StepContext(b.plan), StepScope()
    b.impl.bind_step_scope(scope)
    scope.install(ctx)
    out = torch.full((b.query.shape[0], H * b.hs), float("nan"), dtype=b.query.dtype)
    b.impl.forward(b.layer, b.query, b.key, b.value, b.kv_cache.clone(), b.meta, out)
    scope.clear()
    return out.view(-1, H, b.hs)


def _references(b, window=-1, softcap=0.0):
    refs = []
    for r, (_, prefix, n, parents) in enumerate(b.requests):
        k, v = b.seqs[r]
        refs.append(tree_reference(b.qs[r], k, v, chain_parents(n) if parents is None
                                   else parents, prefix, b.hs ** -0.5, window, softcap))
    return torch.cat(refs)


def _max_err(out, ref) -> float:
    return float((out.float() - ref.float()).abs().max())


# --- the path split ---------------------------------------------------------------------------

def test_split_paths_golden():
    s = split_paths(np.array(TREE_A))
    assert s.nodes == ((0, 1, 2, 3), (0, 4, 6), (0, 1, 7, 8), (0, 1, 2, 10), (0, 5, 9, 11))
    assert s.shared == (0, 1, 2, 3, 1)
    assert s.donor == (-1, 0, 0, 0, 0)
    assert s.on_chain == (4, 1, 2, 3, 1)
    assert s.order == (0, 1, 2, 3, 4, 6, 7, 8, 10, 5, 9, 11)


def test_depth_first_layout_needs_no_permutation():
    """The proposer sends trees depth first: each path's own nodes are then one run, so the
    virtual batch reads queries in place (``order`` is the identity)."""
    parents = np.array([-1, 0, 0, 0, 1, 3, 3, 2, 4])  # a best-first-like layout
    tree = DraftTree(np.arange(9), parents, np.ones(9))
    assert list(split_paths(parents).order) != list(range(9))
    laid = tree.depth_first()
    assert list(split_paths(laid.parents).order) == list(range(9))


def test_split_paths_chain_is_one_path_and_donors_chain():
    assert split_paths(chain_parents(4)).nodes == ((0, 1, 2, 3),)
    s = split_paths(np.array([-1, 0, 0, 2, 2, 4, 4]))  # branches off a non-chain path
    assert s.nodes == ((0, 1), (0, 2, 3), (0, 2, 4, 5), (0, 2, 4, 6))
    assert s.donor == (-1, 0, 1, 2) and s.shared == (0, 1, 2, 3)


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, 0, 3, 1], []])
def test_split_paths_rejects_non_trees(parents):
    with pytest.raises(ValueError, match="parents-first"):
        split_paths(np.array(parents, np.int64))


@pytest.mark.parametrize("prefix, expected", [(64, 2), (70, 2), (62, 3), (61, 4)])
def test_scratch_blocks_needed(prefix, expected):
    # TREE_C at bs 32: side paths [0,5,6,7,8] (shares 1) and [0,1,9,10,11] (shares 2), nodes
    # at P..P+4. From 62 the first one's owned positions 63..66 straddle the block end at 64
    # (2 blocks); the second owns 64..66 only and reuses block 1 (1 block). From 61 both
    # straddle.
    assert scratch_blocks_needed(np.array(TREE_C), prefix, 32) == expected
    assert scratch_blocks_needed(chain_parents(5), prefix, 32) == 0


# --- exactness on a real paged cache ------------------------------------------------------------

CASES = [  # (dtype, block size, head size, window, softcap)
    (torch.float32, 32, 64, None, None), (torch.float32, 128, 128, None, None),
    (torch.float32, 32, 128, 7, None), (torch.float32, 128, 64, None, 30.0),
    (torch.float32, 64, 64, 5, 20.0), (torch.float32, 32, 80, None, None),  # 80: "vec16" ISA
    (torch.bfloat16, 32, 64, None, None), (torch.bfloat16, 128, 128, 7, 30.0),
]


@pytest.mark.parametrize("dtype, bs, hs, window, softcap", CASES)
def test_paths_match_float64_reference_and_old_path(dtype, bs, hs, window, softcap):
    b = _batch(_requests(bs), bs, hs, dtype, window, softcap)
    real = [int(x) for x in b.meta.block_table.flatten().unique()]
    before = b.kv_cache[real].clone()
    out, ctx, vb = _run_paths(b)
    assert not torch.isnan(out).any(), "a row was left unwritten"
    assert torch.equal(b.kv_cache[real], before), "the real blocks were modified"
    assert vb.dense == () and vb.scratch_used > 0 and not vb.identity
    ref = _references(b, -1 if window is None else window, softcap or 0.0)
    old = _run_old(b)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _max_err(out, ref) <= tol
    assert _max_err(out, old) <= tol
    # one stash entry per tree request, with the nodes' own K/V and real slots
    assert [e.batch_index for e in ctx.kv_stash] == [3, 4, 5]
    e = ctx.kv_stash[0]
    qs, n = int(b.qsl[3]), len(TREE_A)
    assert torch.equal(e.key[e.start:e.start + n], b.key[qs:qs + n])
    assert torch.equal(e.slots[e.start:e.start + n], b.meta.slot_mapping[qs:qs + n])


@pytest.mark.parametrize("kv_views", [False, True])
def test_the_stash_holds_views_only_where_the_step_allows(kv_views):
    """Copies by default (a compiled graph may reuse a layer's buffers before acceptance),
    views of the layer's own K/V in an eager step: same values either way."""
    b = _batch(_requests(32), 32, 64, torch.float32, None, None)
    _, ctx, _ = _run_paths(b, kv_views=kv_views)
    qs, n = int(b.qsl[3]), len(TREE_A)
    for e in ctx.kv_stash[:1]:
        assert torch.equal(e.key[e.start:e.start + n], b.key[qs:qs + n])
        assert torch.equal(e.value[e.start:e.start + n], b.value[qs:qs + n])
        shares = [t.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
                  for t, src in ((e.key, b.key), (e.value, b.value),
                                 (e.slots, b.meta.slot_mapping))]
        assert shares == [kv_views] * 3


def test_an_engine_runs_eagerly_only_without_a_compiled_graph():
    from vllm_recap.vllm.proposer import _runs_eagerly

    def config(eager, mode):
        return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=eager),
                               compilation_config=SimpleNamespace(mode=mode))

    assert _runs_eagerly(config(True, 3)) and _runs_eagerly(config(False, 0))
    assert not _runs_eagerly(config(False, 3)) and not _runs_eagerly(config(False, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_tree_rows_equal_the_stock_kernel(dtype):
    """Prefill, decode and chain rows are the stock kernel's, bit for bit (here: no request is
    long enough for the kernel to split its KV across threads, which depends on the batch)."""
    b = _batch(_requests(32), 32, 64, dtype)
    out, _, _ = _run_paths(b)
    stock = torch.full_like(out, float("nan"))
    super(type(b.impl), b.impl).forward(b.layer, b.query, b.key, b.value, b.kv_cache,
                                        b.meta, stock.view(out.shape[0], -1))
    end = int(b.qsl[3])
    assert torch.equal(out[:end], stock[:end])


def test_scattered_scratch_ids_give_the_same_result():
    """Scratch ids that are no run are copied with index_copy_ instead of one copy_."""
    b = _batch(_requests(32), 32, 64, torch.float32)
    run_out, _, run_vb = _run_paths(b)
    shuffled = [b.free[i] for i in torch.randperm(len(b.free)).tolist()]
    out, _, vb = _run_paths(b, shuffled)
    assert all(c.first >= 0 for c in run_vb.tail_copies)
    assert any(c.first < 0 for c in vb.tail_copies)
    assert torch.equal(out, run_out)


def test_scratch_shortage_falls_back_to_dense_recompute():
    b = _batch(_requests(32), 32, 64, torch.float32)
    need = [scratch_blocks_needed(np.array(t), p, 32)
            for t, p in ((TREE_A, 41), (TREE_B, 64), (TREE_C, 61))]
    scratch = b.free[:need[0] + need[2]]  # tree_mid fits, tree_end does not, tree_straddle does
    out, ctx, vb = _run_paths(b, scratch)
    assert [t.batch_index for t in vb.dense] == [4]
    assert vb.scratch_used == need[0] + need[2]
    assert not torch.isnan(out).any()
    assert _max_err(out, _references(b)) <= 1e-5
    _, _, none = _run_paths(b, [])
    assert [t.batch_index for t in none.dense] == [3, 4, 5] and none.scratch_used == 0


def test_scratch_blocks_outside_the_given_list_are_untouched():
    b = _batch(_requests(32), 32, 64, torch.float32)
    before = b.kv_cache.clone()
    _, _, vb = _run_paths(b)
    changed = (b.kv_cache != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= set(b.free[:vb.scratch_used])


def test_step_virtual_batch_is_built_once_per_metadata():
    b = _batch(_requests(32), 32, 64, torch.float32)
    ctx = StepContext(b.plan)
    calls = []

    def scratch():  # the layer's scratch ids, asked for only when the batch is built
        calls.append(1)
        return b.free

    vb = step_virtual_batch(ctx, b.meta, 32, scratch)
    assert step_virtual_batch(ctx, b.meta, 32, scratch) is vb and len(calls) == 1
    other = SimpleNamespace(**vars(b.meta))  # a second KV-cache group's metadata
    vb2 = step_virtual_batch(ctx, other, 32, b.free)
    assert vb2 is not vb and step_virtual_batch(ctx, b.meta, 32, scratch) is vb
    assert step_virtual_batch(ctx, other, 32, scratch) is vb2 and len(calls) == 1
    sched = vb.scheduler_metadata(b.impl, torch.float32, b.layer.isa)
    assert vb.scheduler_metadata(b.impl, torch.float32, b.layer.isa) is sched


def test_tree_size_mismatch_is_an_error():
    b = _batch(_requests(32), 32, 64, torch.float32)
    b.plan.trees[0].parents = b.plan.trees[0].parents[:-1]
    b.plan.trees[0].depths = b.plan.trees[0].depths[:-1]
    with pytest.raises(ValueError, match="tree request 3"):
        VirtualBatch.build(b.plan, b.meta, 32, b.free)


@st.composite
def _trees(draw):
    n = draw(st.integers(2, 24))
    chain = draw(st.integers(0, n - 1))
    parents = [-1] + list(range(chain))
    for i in range(chain + 1, n):
        parents.append(draw(st.integers(0, i - 1)))
    return parents


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees=st.lists(_trees(), min_size=1, max_size=3), prefixes=st.lists(
    st.integers(1, 100), min_size=3, max_size=3), bs=st.sampled_from([32, 64]),
    window=st.sampled_from([None, 3, 16]))
def test_random_trees_match_reference(trees, prefixes, bs, window):
    requests = [("decode", 33, 1, None)] + [
        (f"t{i}", p, len(t), t) for i, (t, p) in enumerate(zip(trees, prefixes))]
    b = _batch(requests, bs, 64, torch.float32, window, seed=len(trees) + prefixes[0])
    out, _, vb = _run_paths(b)
    assert vb.dense == ()
    assert not torch.isnan(out).any()
    assert _max_err(out, _references(b, -1 if window is None else window)) <= 1e-5


def test_cost_benchmark_smoke(capsys):
    """The micro-benchmark runs (tiny size), so it cannot rot."""
    from benchmarks.cpu_tree_attention_cost import main

    rows = main(["--dtypes", "float32", "--prefixes", "40", "--sizes", "1,5", "--repeats", "2",
                 "--evict-mib", "0", "--block-size", "32"])
    assert [r["shape"] for r in rows] == ["decode", "bushy", "chain-like"]
    assert all(r["stock_us"] > 0 and r["paths_us"] > 0 for r in rows)
    assert "paths/stock" in capsys.readouterr().out


def test_cost_benchmark_runs_bfloat16_in_a_fresh_process():
    """In bfloat16 vLLM's kernel uses AMX tiles where the CPU has them, and Linux kills a
    process that touches them before asking for their state (SIGILL): the benchmark runs the
    kernel before any matrix multiply would have asked, so it must ask itself. (A fresh
    process: in this one an earlier test's bfloat16 matmul may have asked already.)"""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "cpu_tree_attention_cost.py"), "--dtypes",
         "bfloat16", "--prefixes", "40", "--sizes", "5", "--repeats", "2", "--evict-mib", "0",
         "--block-size", "32"], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| bfloat16 | 40 | 5 | bushy |" in proc.stdout


def test_block_size_mismatch_is_an_error():
    b = _batch(_requests(32), 32, 64, torch.float32)
    vb = VirtualBatch.build(b.plan, b.meta, 64, b.free)
    out = torch.empty(b.query.shape[0], H * 64)
    with pytest.raises(ValueError, match="block size 64, cache has 32"):
        forward_with_paths(b.impl, b.layer, b.query, b.key, b.value, b.kv_cache, b.meta, vb,
                           out, StepContext(b.plan))


def test_scratch_writes_read_strided_key_value_rows_in_place():
    """When the rows written into scratch are one run (side paths off the best chain, in the
    depth-first layout), they are read as a narrow() view of vLLM's K/V -- here strided
    column slices of one fused QKV tensor, as the model hands them over -- and give what the
    index_select of other trees' rows gives (TREE_A's side paths share nodes: no run)."""
    side = DraftTree(np.zeros(8, np.int64), np.array([-1, 0, 1, 2, 0, 4, 1, 6]),
                     np.ones(8)).depth_first().parents.tolist()
    requests = [("decode", 33, 1, None), ("side", 45, len(side), side),
                ("tree_a", 70, len(TREE_A), TREE_A)]
    for reqs, run in ((requests[:2], True), (requests, False)):
        b = _batch(reqs, 32, 64, torch.float32)
        qkv = torch.cat([b.query.flatten(1), b.key.flatten(1), b.value.flatten(1)], dim=1)
        q_w, kv_w = H * b.hs, KVH * b.hs
        b.key = qkv[:, q_w:q_w + kv_w].view(-1, KVH, b.hs)
        b.value = qkv[:, q_w + kv_w:].view(-1, KVH, b.hs)
        assert not b.key.is_contiguous()
        out, _, vb = _run_paths(b)
        assert vb.dense == () and vb.write_rows.numel() > 0
        rows = vb.write_rows.tolist()
        assert (vb.write_first >= 0) == run == (rows == list(range(rows[0], rows[0] + len(rows))))
        assert _max_err(out, _references(b)) <= 1e-5
