"""Reading K/V rows back out of vLLM's CPU paged KV cache, whatever its in-block layout.

The CPU attention backend stores each (block, kv-head) as one region of 2 * block_size *
head_size elements, but the order inside the region depends on the ISA kernel (for example
the "vec" kernel stores keys dimension-major and values token-major). Instead of hard-coding
one layout per ISA, :func:`probe_layout` writes known values through vLLM's own
``cpu_attn_reshape_and_cache`` op and records where every (token, dim) element of K and V
lands. Any layout that is a permutation inside a (block, head) region is then read exactly;
one that is not (a quantized cache, a new kernel) fails the probe with a clear error.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Where token t, dim d of K and V live inside one (block, kv-head) region.

    Attributes:
        key_index: [block_size * head_size] int64; entry t * head_size + d is the offset of
            K[t, d] inside the region of 2 * block_size * head_size elements.
        value_index: same for V.
        key_form, value_form: "rows" ([block_size, head_size] at some offset), "columns"
            ([head_size, block_size], i.e. transposed) or "scattered"; the first two are read
            with strided views instead of an element gather (several times faster).
        key_base, value_base: offset of the K / V part inside the region (structured forms).
    """

    block_size: int
    head_size: int
    key_index: torch.Tensor
    value_index: torch.Tensor
    key_form: str = "scattered"
    value_form: str = "scattered"
    key_base: int = 0
    value_base: int = 0

    def gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``length`` tokens of a sequence.

        Args:
            kv_cache: [num_blocks, kv_heads, block_size, 2 * head_size] (vLLM's CPU cache).
            block_ids: [>= ceil(length / block_size)] the sequence's block table row.
            length: tokens to read.

        Returns:
            (K, V), each [length, kv_heads, head_size] in the cache's dtype.
        """
        nb, kvh, bs, _ = kv_cache.shape
        n_blocks = -(-length // bs)
        regions = kv_cache.view(nb, kvh, -1)[block_ids[:n_blocks].long()]  # [nblk, kvh, 2*bs*hs]
        k = self._read(regions, self.key_form, self.key_base, self.key_index)
        v = self._read(regions, self.value_form, self.value_base, self.value_index)
        return k[:length], v[:length]

    def _read(self, regions: torch.Tensor, form: str, base: int, index: torch.Tensor):
        n_blocks, kvh, _ = regions.shape
        bs, hs = self.block_size, self.head_size
        part = regions[:, :, base:base + bs * hs]
        if form == "rows":
            blocks = part.view(n_blocks, kvh, bs, hs)
        elif form == "columns":
            blocks = part.view(n_blocks, kvh, hs, bs).transpose(2, 3)
        else:
            blocks = regions[:, :, index].view(n_blocks, kvh, bs, hs)
        return blocks.permute(0, 2, 1, 3).reshape(n_blocks * bs, kvh, hs)


def _form(index: torch.Tensor, bs: int, hs: int) -> tuple[str, int]:
    """Recognises a [bs, hs] ("rows") or [hs, bs] ("columns") block at some base offset."""
    base = int(index.min())
    rel = (index - base).view(bs, hs)
    t = torch.arange(bs)[:, None]
    d = torch.arange(hs)[None, :]
    if torch.equal(rel, t * hs + d):
        return "rows", base
    if torch.equal(rel, d * bs + t):
        return "columns", base
    return "scattered", 0


def _write(dtype, block_size, head_size, isa, key, value, slots):
    from vllm import _custom_ops as ops

    cache = torch.zeros(2, 2, block_size, 2 * head_size, dtype=dtype)
    view = cache.view(2, 2, block_size * 2, head_size)
    key_cache, value_cache = view.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key.to(dtype), value.to(dtype), key_cache, value_cache,
                                   slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    return cache


@functools.lru_cache(maxsize=None)
def probe_layout(dtype: torch.dtype, block_size: int, head_size: int, isa: str) -> KVLayout:
    """Finds the in-block layout of the CPU KV cache by writing labelled values through vLLM.

    Labels are small integers (exact in bf16/fp16): one pass labels tokens, two passes label
    the dimension (low and high 6 bits). The map is checked on a second block and head.

    Raises:
        RuntimeError: the cache layout is not a per-(block, head) permutation of K and V.
    """
    bs, hs = block_size, head_size
    slots = torch.arange(bs, dtype=torch.int64) + bs  # block 1: checks blocks are independent
    t = torch.arange(bs, dtype=torch.float32)[:, None, None].expand(bs, 2, hs)
    d = torch.arange(hs, dtype=torch.float32)[None, None, :].expand(bs, 2, hs)
    labels = {"t": t + 1, "lo": d % 64 + 1, "hi": torch.div(d, 64, rounding_mode="floor") + 1}
    found = {}
    for name, lab in labels.items():
        # K gets +label, V gets -label, head 1 gets label + 100 (so regions can be told apart)
        lab2 = lab.clone()
        lab2[:, 1] += 100
        cache = _write(dtype, bs, hs, isa, lab2, -lab2, slots).float()
        found[name] = cache[1].reshape(2, -1)  # [head, region]
    region = 2 * bs * hs
    key_index = torch.full((bs * hs,), -1, dtype=torch.int64)
    value_index = torch.full((bs * hs,), -1, dtype=torch.int64)
    head0 = {k: v[0] for k, v in found.items()}
    ok = bool((found["t"][1].abs() > 100).all())  # head 1 filled entirely with head-1 labels
    is_key = head0["t"] > 0
    tok = head0["t"].abs().long() - 1
    dim = (head0["hi"].abs().long() - 1) * 64 + head0["lo"].abs().long() - 1
    flat = tok * hs + dim
    offsets = torch.arange(region)
    ok = ok and bool((head0["t"] != 0).all())
    if ok:
        key_index[flat[is_key]] = offsets[is_key]
        value_index[flat[~is_key]] = offsets[~is_key]
        ok = bool((key_index >= 0).all() and (value_index >= 0).all())
    if not ok:
        raise RuntimeError(
            f"vllm-recap tree attention: the CPU KV cache layout (dtype {dtype}, block size "
            f"{bs}, head size {hs}, ISA {isa!r}) is not a per-block permutation of K and V, so "
            "tree nodes cannot read the prefix. Use speculative_config "
            "{'method': 'recap', 'draft_mode': 'chain'} instead."
        )
    key_form, key_base = _form(key_index, bs, hs)
    value_form, value_base = _form(value_index, bs, hs)
    return KVLayout(bs, hs, key_index, value_index, key_form, value_form, key_base, value_base)
