"""The CUDA tree-attention path's pure-torch parts, on CPU, against the dense reference.

The FlashAttention prefix kernel itself needs a GPU (tests/gpu); here the same recompute runs
with its torch prefix part over a synthetic FlashAttention-layout paged cache. Outputs are
poisoned with NaN first, so a tree row the recompute forgets to write fails, and every other
row must stay untouched.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.reference_attention import dense_attention, tree_reference
from vllm_recap.core.tree import DraftTree
from vllm_recap.vllm import cuda_recompute as cb
from vllm_recap.vllm.attention_math import merge_by_lse
from vllm_recap.vllm.context import StepContext
from vllm_recap.vllm.layout import build_plan, chain_parents

pytestmark = pytest.mark.unit

H, KVH, D, BS, NUM_BLOCKS = 4, 2, 16, 8, 24
TREE_A = np.array([-1, 0, 0, 0, 1, 3, 3, 4, 4])
TREE_B = np.array([-1, 0, 1, 0, 3, 3])
# (name, prefix length, parents of the scheduled tokens (None: a prefill chunk), blocks)
REQUESTS = [("tree_a", 21, TREE_A, [7, 2, 11, 4]), ("prefill", 0, None, [0, 1]),
            ("chain", 9, chain_parents(3), [5, 6]), ("tree_b", 30, TREE_B, [20, 3, 9, 13, 8])]
PREFILL_LEN = 10


def _physical_nhd_cache(dtype=torch.float32) -> torch.Tensor:
    """A logical [blocks, kvh, bs, 2D] view over token-major storage (a non-default layout)."""
    return torch.zeros(NUM_BLOCKS, BS, KVH, 2 * D, dtype=dtype).permute(0, 2, 1, 3)


def _step(seed: int, *, sliding_window: int = -1, softcap: float = 0.0):
    """One synthetic engine step: paged cache, flat q/k/v, metadata, plan, NaN output."""
    g = torch.Generator().manual_seed(seed)
    cache = _physical_nhd_cache()
    seqs, qs, ks, vs, slots, rows = [], [], [], [], [], []
    for _name, prefix, parents, blocks in REQUESTS:
        n = PREFILL_LEN if parents is None else len(parents)
        k = torch.randn(prefix + n, KVH, D, generator=g)
        v = torch.randn(prefix + n, KVH, D, generator=g)
        pos = torch.arange(prefix + n)
        blk = torch.tensor(blocks)[pos // BS]
        cache[blk, :, pos % BS] = torch.cat([k, v], -1)  # as vLLM's pre-forward cache write
        seqs.append((k, v))
        qs.append(torch.randn(n, H, D, generator=g))
        ks.append(k[prefix:])
        vs.append(v[prefix:])
        slots.append((blk * BS + pos % BS)[prefix:])
        rows.append(blocks + [0] * (6 - len(blocks)))
    n_tok = [len(q) for q in qs]
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(n_tok)]), dtype=torch.int32)
    md = SimpleNamespace(
        query_start_loc=qsl, block_table=torch.tensor(rows, dtype=torch.int32),
        seq_lens=torch.tensor([r[1] + n for r, n in zip(REQUESTS, n_tok)], dtype=torch.int32),
        slot_mapping=torch.cat(slots))
    trees = {r[0]: DraftTree(np.zeros(len(r[2]), np.int64), np.asarray(r[2]),
                             np.ones(len(r[2]))) for r in REQUESTS if r[2] is not None}
    drafts = {name: t.draft_tokens.tolist() for name, t in trees.items()}
    plan = build_plan([r[0] for r in REQUESTS], np.array(n_tok), qsl.numpy(), drafts, trees,
                      np.array([r[1] for r in REQUESTS]), np.ones(len(REQUESTS)))
    cfg = cb.HeadConfig(H, D, D ** -0.5, sliding_window, softcap)
    query, key, value = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    output = torch.full((int(qsl[-1]), H * D), float("nan"))
    return SimpleNamespace(cache=cache, seqs=seqs, q=qs, query=query, key=key, value=value,
                           md=md, plan=plan, ctx=StepContext(plan), cfg=cfg, output=output,
                           qsl=qsl)


def _expected(s, r: int) -> torch.Tensor:
    _name, prefix, parents, _ = REQUESTS[r]
    k, v = s.seqs[r]
    return tree_reference(s.q[r], k, v, parents, prefix, s.cfg.scale, s.cfg.sliding_window,
                          s.cfg.softcap)


def _tree_rows(s) -> list[int]:
    return [t.batch_index for t in s.plan.trees]


@pytest.mark.parametrize("seed,window,softcap", [(0, -1, 0.0), (1, -1, 0.0), (2, 6, 0.0),
                                                 (3, -1, 5.0), (4, 13, 30.0)])
def test_recompute_matches_dense_reference_and_writes_only_tree_rows(seed, window, softcap):
    s = _step(seed, sliding_window=window, softcap=softcap)
    cb.recompute_tree_rows(s.cfg, s.ctx, s.query, s.key, s.value, s.cache, s.md, s.output,
                           stash_owner=("impl", "layer"))
    out = s.output.view(-1, H, D)
    written = torch.zeros(out.shape[0], dtype=torch.bool)
    for r in _tree_rows(s):
        a, b = int(s.qsl[r]), int(s.qsl[r + 1])
        written[a:b] = True
        torch.testing.assert_close(out[a:b], _expected(s, r), rtol=1e-5, atol=1e-5)
    assert torch.isnan(out[~written]).all(), "a non-tree row was overwritten"
    assert not torch.isnan(out[written]).any()


def test_stash_holds_each_tree_requests_kv_and_slots():
    s = _step(5)
    cb.recompute_tree_rows(s.cfg, s.ctx, s.query, s.key, s.value, s.cache, s.md, s.output,
                           stash_owner=("impl", "layer"))
    assert [e.batch_index for e in s.ctx.kv_stash] == [0, 3]
    for e in s.ctx.kv_stash:
        a, z = int(s.qsl[e.batch_index]), int(s.qsl[e.batch_index + 1])
        assert (e.writer, e.layer, e.kv_cache) == ("impl", "layer", s.cache)
        torch.testing.assert_close(e.key, s.key[a:z], rtol=0, atol=0)
        torch.testing.assert_close(e.value, s.value[a:z], rtol=0, atol=0)
        assert torch.equal(e.slots, s.md.slot_mapping[a:z])
    s.md.slot_mapping.fill_(-1)  # vLLM reuses the buffer next step: the stash must not alias it
    assert (s.ctx.kv_stash[0].slots >= 0).all()


def test_key_value_bypass_reads_the_nodes_from_their_slots():
    s, t = _step(6), _step(6)
    cb.recompute_tree_rows(s.cfg, s.ctx, s.query, s.key, s.value, s.cache, s.md, s.output)
    cb.recompute_tree_rows(t.cfg, t.ctx, t.query, None, None, t.cache, t.md, t.output)
    torch.testing.assert_close(s.output, t.output, rtol=0, atol=0, equal_nan=True)
    assert s.ctx.kv_stash == []  # no owner: nothing stashed


def test_tree_attention_equals_chain_attention_over_ancestors():
    """Row i of a tree = plain causal attention over prefix + the path root..i."""
    s = _step(7)
    cb.recompute_tree_rows(s.cfg, s.ctx, s.query, s.key, s.value, s.cache, s.md, s.output)
    out = s.output.view(-1, H, D)
    for r in _tree_rows(s):
        _name, prefix, parents, _ = REQUESTS[r]
        k, v = s.seqs[r]
        for i in range(len(parents)):
            path, j = [], i
            while j >= 0:
                path.append(prefix + j)
                j = int(parents[j])
            idx = torch.tensor(list(range(prefix)) + path[::-1])
            causal = torch.ones(1, len(idx), dtype=torch.bool)
            chain = dense_attention(s.q[r][i:i + 1], k[idx], v[idx], causal, s.cfg.scale)
            torch.testing.assert_close(out[int(s.qsl[r]) + i], chain[0], rtol=1e-5, atol=1e-5)


def test_merge_by_lse_handles_empty_parts():
    g = torch.Generator().manual_seed(0)
    o = torch.randn(3, 2, 4, generator=g)
    lse = torch.randn(3, 2, generator=g)
    zero = torch.zeros_like(o)
    ninf, pinf = torch.full_like(lse, -torch.inf), torch.full_like(lse, torch.inf)
    for empty in (ninf, pinf):  # FlashAttention reports empty rows as -inf or +inf
        out, merged = merge_by_lse(o, lse, zero, empty)
        torch.testing.assert_close(out, o)
        torch.testing.assert_close(merged, lse)
    out, merged = merge_by_lse(zero, ninf, zero, pinf)
    assert torch.equal(out, zero) and torch.isneginf(merged).all()


def test_gather_prefix_flash_reads_written_tokens_from_both_layouts():
    g = torch.Generator().manual_seed(1)
    blocks = torch.tensor([9, 0, 17, 4], dtype=torch.int32)
    length = 3 * BS + 5
    k, v = torch.randn(length, KVH, D, generator=g), torch.randn(length, KVH, D, generator=g)
    pos = torch.arange(length)
    slots = blocks[pos // BS].long() * BS + pos % BS
    nhd = _physical_nhd_cache(torch.bfloat16)  # token-major storage (vLLM's LBNHC layout)
    hnd = torch.zeros(NUM_BLOCKS, KVH, BS, 2 * D, dtype=torch.bfloat16)  # identity (LBHNC)
    for cache4 in (nhd, hnd):
        cache4[slots // BS, :, slots % BS] = torch.cat([k, v], -1).bfloat16()
    cache5 = torch.zeros(2, NUM_BLOCKS, BS, KVH, D)  # vLLM <= 0.2x: [2, blocks, bs, kvh, D]
    cache5[0, slots // BS, slots % BS], cache5[1, slots // BS, slots % BS] = k, v
    for cache, dtype in ((nhd, torch.bfloat16), (hnd, torch.bfloat16), (cache5, torch.float32)):
        for start in (0, 3, BS, 2 * BS + 1):
            gk, gv = cb.gather_prefix_flash(cache, blocks, length, start)
            assert gk.dtype == dtype and gk.shape == (length - start, KVH, D)
            torch.testing.assert_close(gk, k[start:].to(dtype), rtol=0, atol=0)
            torch.testing.assert_close(gv, v[start:].to(dtype), rtol=0, atol=0)
    rk, rv = cb.read_slots_flash(nhd, slots[[5, 27, 2]])
    torch.testing.assert_close(rk, k[[5, 27, 2]].bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(rv, v[[5, 27, 2]].bfloat16(), rtol=0, atol=0)


def test_head_config_reads_flash_attention_impl_fields():
    impl = SimpleNamespace(num_heads=28, head_size=128, scale=0.088, sliding_window=(4095, 0),
                           logits_soft_cap=0, vllm_flash_attn_version=3)
    assert cb.HeadConfig.from_impl(impl) == cb.HeadConfig(28, 128, 0.088, 4096, 0.0, 3)
    impl.sliding_window = (-1, -1)
    assert cb.HeadConfig.from_impl(impl).sliding_window == -1


class _Enum:
    FLASH_ATTN = SimpleNamespace(name="FLASH_ATTN")
    TRITON_ATTN = SimpleNamespace(name="TRITON_ATTN")


def test_install_pins_flash_attn_and_registers_the_subclass():
    calls = []
    config = SimpleNamespace(attention_config=SimpleNamespace(backend=None, backend_per_kind={}))
    assert cb.install_cuda_backend(config, lambda b, path: calls.append((b, path)), _Enum) is None
    assert config.attention_config.backend is _Enum.FLASH_ATTN
    assert calls == [(_Enum.FLASH_ATTN, "vllm_recap.vllm.cuda_backend.RecapFlashAttentionBackend")]


@pytest.mark.parametrize("backend,per_kind", [(_Enum.TRITON_ATTN, {}),
                                              (None, {"full_attention": _Enum.TRITON_ATTN})])
def test_another_requested_backend_means_chains_not_a_failed_start(backend, per_kind):
    config = SimpleNamespace(attention_config=SimpleNamespace(backend=backend,
                                                              backend_per_kind=per_kind))
    calls = []
    reason = cb.install_cuda_backend(config, lambda *a: calls.append(a), _Enum)
    assert "asks for TRITON_ATTN" in reason and calls == []
    assert config.attention_config.backend is backend  # nothing pinned


def test_layer_reasons_name_what_the_tree_path_cannot_do():
    ok = dict(alibi_slopes=None, sinks=None, kv_cache_dtype="auto", dcp_world_size=1)
    md = SimpleNamespace(rswa_prefix_lens=None)
    assert cb.layer_reason(SimpleNamespace(**ok)) is None
    cb.check_supported(SimpleNamespace(**ok), md)
    for bad, words in (({"kv_cache_dtype": "fp8"}, "'fp8' KV cache"),
                       ({"sinks": torch.zeros(1)}, "attention sinks"),
                       ({"dcp_world_size": 2}, "decode context parallelism")):
        assert words in cb.layer_reason(SimpleNamespace(**{**ok, **bad}))
        with pytest.raises(RuntimeError, match="draft_mode': 'chain'"):
            cb.check_supported(SimpleNamespace(**{**ok, **bad}), md)


def test_module_imports_without_vllm_or_the_core(monkeypatch):
    """Fresh import with vllm, numba and the RECAP core made unimportable (None in sys.modules):
    the GPU script runs it on machines that have torch alone."""
    import importlib

    import vllm_recap.vllm as pkg

    loaded_vllm = [m for m in sys.modules if m.startswith("vllm.")]  # other tests may import it
    for name in ("vllm", "numba", "vllm_recap.core", *loaded_vllm):
        monkeypatch.setitem(sys.modules, name, None)
    for name in ("cuda_recompute", "attention_math", "context"):
        # restore the package attribute too, which the fresh import below rebinds
        monkeypatch.setattr(pkg, name, sys.modules[f"vllm_recap.vllm.{name}"])
        monkeypatch.delitem(sys.modules, f"vllm_recap.vllm.{name}")
    fresh = importlib.import_module("vllm_recap.vllm.cuda_recompute")
    assert fresh is not cb and fresh.flash_varlen_func() is None
