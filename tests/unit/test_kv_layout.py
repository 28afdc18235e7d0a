"""Reading K/V back from vLLM's CPU paged cache through the probed layout."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, head_size", [(32, 64), (128, 32), (16, 128)])
def test_gather_returns_what_vllm_wrote(dtype, block_size, head_size):
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_recap.vllm.kv_layout import probe_layout

    isa = _get_attn_isa(dtype, block_size, head_size, "auto")
    layout = probe_layout(dtype, block_size, head_size, isa)
    kvh, length = 3, 2 * block_size + 7
    cache = torch.zeros(5, kvh, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(5, kvh, 2 * block_size, head_size).chunk(2, dim=2)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(length, kvh, head_size, generator=g).to(dtype)
    v = torch.randn(length, kvh, head_size, generator=g).to(dtype)
    blocks = torch.tensor([3, 0, 4, 1])
    slots = torch.tensor([int(blocks[p // block_size]) * block_size + p % block_size
                          for p in range(length)])
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa, k_scale=1.0,
                                   v_scale=1.0, kv_cache_dtype="auto")
    for form in ("structured", "scattered"):
        lay = layout if form == "structured" else dataclasses.replace(
            layout, key_form="scattered", value_form="scattered")
        k2, v2 = lay.gather(cache, blocks, length)
        assert torch.equal(k2, k) and torch.equal(v2, v), form
