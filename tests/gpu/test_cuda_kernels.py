"""The CUDA tree-attention path on a GPU, against the dense fp32 reference, in bf16.

Torch-path tests need only torch + CUDA. The FlashAttention tests need vLLM's CUDA build
(``vllm.vllm_flash_attn``) and are skipped without it; the full-impl test also runs vLLM's
stock FlashAttention forward and its cache writer, so it checks the KV layout end to end.
Outputs are poisoned with NaN first, so unwritten rows fail.
"""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks.gpu_tree_verify import check_recompute, flash_version, random_tree, synthetic_step
from tests.reference_attention import dense_attention, visible
from vllm_recap.vllm import cuda_recompute as cb
from vllm_recap.vllm.attention_math import masked_attention

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16_TOL = 2e-2
CHAIN = np.arange(-1, 2)
# name -> (heads, kv heads, head size, [(prefix, parents)]): a tree batch with a chain between
SHAPES = {
    "small": (4, 2, 64, [(100, random_tree(16, np.random.default_rng(0))), (7, CHAIN),
                         (260, random_tree(33, np.random.default_rng(1)))]),
    "7b": (28, 4, 128, [(1000, random_tree(64, np.random.default_rng(2))), (3, CHAIN),
                        (2047, random_tree(128, np.random.default_rng(3))),
                        (513, random_tree(8, np.random.default_rng(4)))]),
}


def _flash_versions() -> list[int]:
    if flash_version() is None:
        return []
    from vllm.vllm_flash_attn import is_fa_version_supported

    return [v for v in (2, 3) if is_fa_version_supported(v)]


needs_flash = pytest.mark.skipif(not _flash_versions(), reason="vLLM FlashAttention not importable")


def _step(shape: str, seed: int = 0):
    h, kvh, d, requests = SHAPES[shape]
    return synthetic_step(torch.device("cuda"), torch.bfloat16, h, kvh, d, requests, seed=seed), \
        cb.HeadConfig(h, d, d ** -0.5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window,softcap", [(-1, 0.0), (-1, 30.0), (300, 0.0)])
def test_torch_path_matches_reference(shape, window, softcap):
    step, cfg = _step(shape)
    got = check_recompute(step, replace(cfg, sliding_window=window, softcap=softcap), BF16_TOL)
    assert got["passed"], got


@needs_flash
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("version", _flash_versions() or [None])
def test_flash_path_matches_reference(shape, softcap, version):
    step, cfg = _step(shape, seed=1)
    got = check_recompute(step, replace(cfg, softcap=softcap, fa_version=version), BF16_TOL)
    assert got["passed"], got


@needs_flash
@pytest.mark.parametrize("version", _flash_versions() or [None])
def test_flash_prefix_lse_is_natural_log_per_row(version):
    """FlashAttention's prefix output and LSE (layout, base) == the torch prefix part."""
    step, cfg = _step("7b", seed=2)
    batch = cb.tree_batch(step.ctx, step.md, step.query.device)
    q = step.query.index_select(0, batch.rows)
    out, lse = cb.flash_prefix_attention(q, step.cache, step.md.block_table, batch,
                                         replace(cfg, fa_version=version))
    off = 0
    for b, n, p in zip(batch.requests, batch.nodes, batch.prefixes):
        k_pre, v_pre = cb.gather_prefix_flash(step.cache, step.md.block_table[b], p)
        ref_o, ref_l = masked_attention(q[off:off + n], k_pre, v_pre, None, cfg.scale)
        torch.testing.assert_close(out[off:off + n].float(), ref_o, rtol=BF16_TOL, atol=BF16_TOL)
        torch.testing.assert_close(lse[off:off + n], ref_l, rtol=1e-3, atol=5e-3)
        off += n


@needs_flash
def test_impl_forward_and_kv_compaction_end_to_end():
    """vLLM's cache writer, stock forward + tree rows, then compaction of an off-chain path."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    from vllm_recap.core.tree import DraftTree
    from vllm_recap.vllm.context import StepContext, StepScope
    from vllm_recap.vllm.cuda_backend import RecapFlashAttentionImpl
    from vllm_recap.vllm.layout import build_plan
    from vllm_recap.vllm.verifier import compact_kv

    h, kvh, d, requests = SHAPES["small"]
    dev, bs = torch.device("cuda"), 16
    # what FlashAttentionImpl.__init__ reads from the current config (vLLM 0.33)
    fake = SimpleNamespace(model_config=None,
                           attention_config=SimpleNamespace(flash_attn_version=None),
                           parallel_config=SimpleNamespace(decode_context_parallel_size=1,
                                                           dcp_comm_backend="ag_rs"))
    with set_current_vllm_config(fake):
        impl = RecapFlashAttentionImpl(num_heads=h, head_size=d, scale=d ** -0.5,
                                          num_kv_heads=kvh, alibi_slopes=None,
                                          sliding_window=None, kv_cache_dtype="auto")
    one = torch.ones(1, device=dev)
    layer = SimpleNamespace(_q_scale=one, _k_scale=one, _v_scale=one)
    ref = synthetic_step(dev, torch.bfloat16, h, kvh, d, requests, block_size=bs, seed=3)
    cache = torch.zeros_like(ref.cache.transpose(1, 2)).transpose(1, 2)  # same strides, empty
    prefix_slots = []
    for b, (p, _) in enumerate(requests):  # write each prefix through vLLM's cache writer
        pos = torch.arange(p, device=dev)
        prefix_slots.append(ref.md.block_table[b].long()[pos // bs] * bs + pos % bs)
    k_all = torch.cat([k[:p] for (k, _), (p, _) in zip(ref.seqs, requests)]).to(dev)
    v_all = torch.cat([v[:p] for (_, v), (p, _) in zip(ref.seqs, requests)]).to(dev)
    impl.do_kv_cache_update(layer, k_all, v_all, cache, torch.cat(prefix_slots))
    impl.do_kv_cache_update(layer, ref.key, ref.value, cache, ref.md.slot_mapping)
    assert torch.equal(cache, ref.cache), "vLLM's cache writer disagrees with gather_prefix_flash"

    n_tok = [len(par) for _, par in requests]
    md = FlashAttentionMetadata(
        num_actual_tokens=sum(n_tok), max_query_len=max(n_tok),
        query_start_loc=ref.md.query_start_loc, max_seq_len=int(ref.md.seq_lens.max()),
        seq_lens=ref.md.seq_lens,
        block_table=ref.md.block_table, slot_mapping=ref.md.slot_mapping)
    names = [f"r{i}" for i in range(len(requests))]
    proposals = {nm: DraftTree(np.zeros(len(par), np.int64), np.asarray(par),
                               np.ones(len(par))) for nm, (_, par) in zip(names, requests)}
    plan = build_plan(names, np.array(n_tok), ref.qsl.numpy(),
                      {nm: t.draft_tokens.tolist() for nm, t in proposals.items()}, proposals,
                      np.array([p for p, _ in requests]), np.ones(len(requests)))
    out = torch.full((sum(n_tok), h * d), float("nan"), dtype=torch.bfloat16, device=dev)
    scope, ctx = StepScope(), StepContext(plan)
    impl.bind_step_scope(scope)
    scope.install(ctx)
    impl.forward(layer, ref.query, ref.key, ref.value, cache, md, out)
    out = out.view(-1, h, d).float()
    trees = plan.tree_by_batch_index()
    for b, (p, par) in enumerate(requests):
        n = len(par)
        k, v = (t.float().to(dev) for t in ref.seqs[b])
        allowed = torch.ones(n, p + n, dtype=torch.bool).tril(p)
        if b in trees:
            allowed = visible(list(par), p)
        exp = dense_attention(ref.qs[b], k.cpu(), v.cpu(), allowed, d ** -0.5).to(dev)
        a = int(ref.qsl[b])
        torch.testing.assert_close(out[a:a + n], exp, rtol=BF16_TOL, atol=BF16_TOL)

    b, tree = next(iter(trees.items()))
    path = _off_chain_path(tree.parents)
    assert len(ctx.kv_stash) == len(trees) and compact_kv(ctx.kv_stash, {b: path}) == 1
    p = requests[b][0]
    got_k, got_v = cb.gather_prefix_flash(cache, md.block_table[b], p + 1 + len(path), p + 1)
    want_k, want_v = (t[p + torch.from_numpy(path)].to(dev) for t in ref.seqs[b])
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def _off_chain_path(parents: np.ndarray) -> np.ndarray:
    """Nodes (root excluded, depth order) from the root to the deepest node under node 2."""
    depth = {0: 0}
    for i in range(1, len(parents)):
        depth[i] = depth[int(parents[i])] + 1
    under = [i for i in range(2, len(parents)) if _has_ancestor(parents, i, 2)]
    node, path = max(under, key=lambda i: depth[i]), []
    while node > 0:
        path.append(node)
        node = int(parents[node])
    return np.array(path[::-1], np.int64)


def _has_ancestor(parents: np.ndarray, i: int, a: int) -> bool:
    while i > 0 and i != a:
        i = int(parents[i])
    return i == a
