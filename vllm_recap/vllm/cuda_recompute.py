"""Tree rows on CUDA, in pure torch (importable without vLLM; used by the GPU script).

vLLM's FlashAttention kernel is causal over slot order; for a request verifying a tree, slot
order is the flattened tree, so a node would also see earlier siblings and cousins. The CUDA
backend (:mod:`vllm_recap.vllm.cuda_backend`) runs the stock kernel for the whole batch, then
calls :func:`recompute_tree_rows`: each node attends to the committed prefix (read from the
paged cache by FlashAttention itself, non-causal, ``seqused_k`` = prefix length, with the
rows' log-sum-exp) plus its ancestors and itself (a small float32 masked attention), and the
two parts are merged by log-sum-exp. All tree requests of a step go through one kernel call.
The nodes' K/V are stashed for KV compaction exactly as on CPU.

vLLM 0.33 (and 0.32) FlashAttention KV cache, per layer: a logical view
``[num_blocks, kv_heads, block_size, 2 * head_size]`` (K = first half of the last dim, V =
second half) whose strides follow the run's KV cache layout; FlashAttention reads it as
``kv_cache.transpose(1, 2).split(head_size, -1)``. Block ids and slots are in kernel blocks.

Layers with a sliding window take the prefix part in torch, over the window's tail only:
FlashAttention would place the tree queries at their slot positions, not at prefix + depth.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm_recap.vllm.attention_math import masked_attention, merge_by_lse, window_allowed
from vllm_recap.vllm.context import StashedKV, StepContext

BACKEND_PATH = "vllm_recap.vllm.cuda_backend.RecapFlashAttentionBackend"
_SUPPORTED_CACHE_DTYPES = ("auto", "float16", "bfloat16")
# Kept here, not imported from tree_backend (which imports vLLM): this module must import
# where vLLM is absent.
_CHAIN_HINT = "use speculative_config {'method': 'recap', 'draft_mode': 'chain'}"


def install_cuda_backend(vllm_config, register, enum) -> str | None:
    """Makes every decoder attention layer use ``RecapFlashAttentionBackend``.

    Tree rows are only correct on the backend that recomputes them, so instead of wrapping
    whatever vLLM would pick, the attention backend is pinned to FLASH_ATTN (vLLM's default on
    Ampere/Hopper) and that enum member is pointed at the tree-aware subclass.

    Args:
        vllm_config: the worker's ``VllmConfig`` (its ``attention_config`` is updated).
        register: vLLM's ``register_backend(backend, class_path)``.
        enum: vLLM's ``AttentionBackendEnum``.

    Returns:
        None when pinned; else why not (another backend was asked for, by the user or the
        model's config), and nothing is changed: the engine then verifies chains.
    """
    attn = getattr(vllm_config, "attention_config", None)
    chosen = getattr(attn, "backend", None)
    per_kind = dict(getattr(attn, "backend_per_kind", None) or {})
    others = [b for b in [chosen, *per_kind.values()] if b is not None and b != enum.FLASH_ATTN]
    if others:
        names = ", ".join(getattr(b, "name", str(b)) for b in others)
        return (f"tree verification on CUDA runs on the FLASH_ATTN attention backend, but "
                f"attention_config asks for {names} (attention_backend or the model's config)")
    if attn is not None:
        attn.backend = enum.FLASH_ATTN  # the selector reads this before any priority list
    register(enum.FLASH_ATTN, BACKEND_PATH)
    return None


def gather_prefix_flash(kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int,
                        start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of tokens ``start..length-1`` of one sequence, read from a FlashAttention cache.

    Args:
        kv_cache: [num_blocks, kv_heads, block_size, 2 * head_size] (vLLM 0.32/0.33; any
            strides), or the older [2, num_blocks, block_size, kv_heads, head_size].
        block_ids: [>= ceil(length / block_size)] the sequence's block-table row.
        length: end (exclusive) of the token range.
        start: first token to read.

    Returns:
        (K, V), each [length - start, kv_heads, head_size] in the cache's dtype.
    """
    five_d = kv_cache.dim() == 5
    bs = kv_cache.shape[2]
    first, last = start // bs, -(-length // bs)
    ids = block_ids[first:last].long()
    lo, hi = start - first * bs, length - first * bs
    if five_d:
        k = kv_cache[0][ids].flatten(0, 1)[lo:hi]  # [blocks * bs, kvh, hs]
        v = kv_cache[1][ids].flatten(0, 1)[lo:hi]
        return k, v
    kv = kv_cache[ids].transpose(1, 2).flatten(0, 1)[lo:hi]  # [tokens, kvh, 2 * hs]
    hs = kv.shape[-1] // 2
    return kv[..., :hs], kv[..., hs:]


def read_slots_flash(kv_cache: torch.Tensor, slots: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V stored at the given slots ([n] int64, slot = block * block_size + offset).

    Returns:
        (K, V), each [n, kv_heads, head_size].
    """
    bs = kv_cache.shape[2]
    kv = kv_cache[slots // bs, :, slots % bs]  # [n, kvh, 2 * hs]
    hs = kv.shape[-1] // 2
    return kv[..., :hs], kv[..., hs:]


@dataclass(frozen=True)
class HeadConfig:
    """What the recompute needs from an attention layer.

    Attributes:
        sliding_window: in tokens, vLLM's int (keys with position <= query position - window
            are masked); -1 for none. FlashAttentionImpl stores it as (window - 1, 0).
        fa_version: vLLM's FlashAttention version for the prefix kernel; None = torch path.
    """

    num_heads: int
    head_size: int
    scale: float
    sliding_window: int = -1
    softcap: float = 0.0
    fa_version: int | None = None

    @classmethod
    def from_impl(cls, impl) -> HeadConfig:
        left = impl.sliding_window[0] if impl.sliding_window is not None else -1
        # FA4's head-256 Blackwell kernel wants page-aligned, exact-width tables: use torch
        version = None if getattr(impl, "fa4_hd256", False) else impl.vllm_flash_attn_version
        return cls(impl.num_heads, impl.head_size, impl.scale, left + 1 if left >= 0 else -1,
                   float(impl.logits_soft_cap or 0.0), version)


@dataclass
class TreeBatch:
    """All tree requests of one step, laid out for batched kernels (built once per step).

    Attributes:
        rows: [N] int64 flat-batch token indices of all tree nodes (tree by tree).
        cu_nodes: [T + 1] int32 cumulative node counts (FlashAttention's cu_seqlens_q).
        prefix_lens: [T] int32 committed prefix length P of each tree request (seqused_k).
        batch_index: [T] int64 rows of the requests in the block table.
        mask: [N, N] bool block-diagonal ancestor mask.
        positions: [N] int64 node positions (P + depth).
        requests, starts, nodes, prefixes: per tree, host ints (batch index, query start,
            node count, P).
    """

    rows: torch.Tensor
    cu_nodes: torch.Tensor
    prefix_lens: torch.Tensor
    batch_index: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    requests: list[int]
    starts: list[int]
    nodes: list[int]
    prefixes: list[int]

    @classmethod
    def build(cls, trees: list, attn_metadata, device: torch.device) -> TreeBatch:
        requests = [t.batch_index for t in trees]
        dev_idx = torch.tensor(requests, dtype=torch.int64).to(device)
        # one device->host copy per step: query starts and sequence lengths of the tree requests
        meta = torch.stack([attn_metadata.query_start_loc[dev_idx].long(),
                            attn_metadata.seq_lens[dev_idx].long()]).cpu()
        starts = meta[0].tolist()
        nodes = [t.num_nodes for t in trees]
        prefixes = [s - n for s, n in zip(meta[1].tolist(), nodes)]
        if min(prefixes) < 0:
            raise RuntimeError(f"vllm-recap: a tree has more nodes than its sequence {prefixes}")
        total = sum(nodes)
        mask = torch.zeros(total, total, dtype=torch.bool)
        positions, rows, off = [], [], 0
        for t, qs, n, p in zip(trees, starts, nodes, prefixes):
            mask[off:off + n, off:off + n] = torch.from_numpy(t.ancestor_mask)
            positions.append(torch.from_numpy(t.depths).long() + p)
            rows.append(torch.arange(qs, qs + n))
            off += n
        cu = torch.tensor([0, *torch.tensor(nodes).cumsum(0).tolist()], dtype=torch.int32)
        return cls(torch.cat(rows).to(device), cu.to(device),
                   torch.tensor(prefixes, dtype=torch.int32).to(device), dev_idx,
                   mask.to(device), torch.cat(positions).to(device), requests, starts, nodes,
                   prefixes)


def tree_batch(ctx: StepContext, attn_metadata, device: torch.device) -> TreeBatch:
    """The step's :class:`TreeBatch`, built by the first layer and kept in the step context."""
    if not isinstance(ctx.backend_state, TreeBatch):
        ctx.backend_state = TreeBatch.build(ctx.plan.trees, attn_metadata, device)
    return ctx.backend_state


@functools.cache
def flash_varlen_func():
    """vLLM's ``flash_attn_varlen_func``, or None where vLLM's CUDA build is missing."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception:  # ImportError, or vLLM's own error when the FA extensions are absent
        return None
    return flash_attn_varlen_func


def flash_prefix_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           batch: TreeBatch, cfg: HeadConfig
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix part of all trees in one non-causal paged FlashAttention call.

    Args:
        q: [N, H, D] node queries (cache dtype).
        kv_cache: one layer's FlashAttention cache (see module docstring).
        block_table: [B, max_blocks] int32, the layer group's block table.

    Returns:
        (out [N, H, D] in q's dtype, lse [N, H] float32).
    """
    key_cache, value_cache = kv_cache.transpose(1, 2).split(cfg.head_size, dim=-1)
    try:  # FA3/FA4 use TMA, which rejects degenerate strides on size-1 dims (as vLLM does)
        from vllm.utils.torch_utils import canonicalize_singleton_dim_strides as canon
        key_cache, value_cache = canon(key_cache), canon(value_cache)
    except ImportError:
        pass
    out, lse = flash_varlen_func()(
        q=q, k=key_cache, v=value_cache, max_seqlen_q=max(batch.nodes),
        cu_seqlens_q=batch.cu_nodes, max_seqlen_k=max(1, max(batch.prefixes)),
        seqused_k=batch.prefix_lens, softmax_scale=cfg.scale, causal=False,
        softcap=cfg.softcap, block_table=block_table.index_select(0, batch.batch_index),
        return_softmax_lse=True, fa_version=cfg.fa_version)
    n, h = q.shape[0], q.shape[1]
    # documented as [H, total_q] (FA2/3/4 varlen); FA4's q_v path gives [total_q, H]
    lse = lse.transpose(0, 1) if lse.shape[0] == h and lse.shape[1] == n else lse
    if tuple(lse.shape) != (n, h):
        raise RuntimeError(f"vllm-recap: unexpected FlashAttention LSE shape {tuple(lse.shape)} "
                           f"for {n} queries x {h} heads")
    return out, lse.float()


def recompute_tree_rows(cfg: HeadConfig, ctx: StepContext, query: torch.Tensor,
                        key: torch.Tensor | None, value: torch.Tensor | None,
                        kv_cache: torch.Tensor, attn_metadata, output: torch.Tensor,
                        stash_owner: tuple | None = None) -> None:
    """Overwrites the output rows of every tree request with exact tree attention.

    Args:
        cfg: the layer's heads, scale, window, soft cap and FlashAttention version.
        ctx: the step context (``plan.trees``; ``kv_stash`` receives the nodes' K/V).
        query: [T, H, D]; key, value: [T, KVH, D] or None when a fused op already wrote them
            to the cache (then they are read back from their slots).
        kv_cache: the layer's FlashAttention cache, already holding this step's K/V.
        attn_metadata: vLLM's FlashAttentionMetadata (query_start_loc, seq_lens, block_table,
            slot_mapping).
        output: [T, H * D] or [T, H, D], written in place.
        stash_owner: (impl, layer) to stash the nodes' K/V for KV compaction; None = don't.
    """
    batch = tree_batch(ctx, attn_metadata, query.device)
    h, d = cfg.num_heads, cfg.head_size
    q = query.view(-1, h, d).index_select(0, batch.rows)
    slots = attn_metadata.slot_mapping.index_select(0, batch.rows)  # vLLM reuses its buffer
    if key is None or value is None:
        k_tree, v_tree = read_slots_flash(kv_cache, slots)
    else:
        k_tree, v_tree = key.index_select(0, batch.rows), value.index_select(0, batch.rows)
    block_table = attn_metadata.block_table
    if cfg.fa_version is not None and cfg.sliding_window <= 0 and query.is_cuda \
            and flash_varlen_func() is not None:
        o1, l1 = flash_prefix_attention(q, kv_cache, block_table, batch, cfg)
    else:
        # torch fallback; with a sliding window only the window's tail of the prefix is read,
        # since FlashAttention would place tree queries at slot positions, not P + depth
        o1, l1 = _torch_prefix_parts(q, kv_cache, block_table, batch, cfg)
    allowed = batch.mask
    if cfg.sliding_window > 0:
        allowed = allowed & window_allowed(batch.positions, batch.positions, cfg.sliding_window)
    o2, l2 = masked_attention(q, k_tree, v_tree, allowed, cfg.scale, cfg.softcap)
    merged, _ = merge_by_lse(o1, l1, o2, l2)
    output.view(-1, h, d).index_copy_(0, batch.rows, merged.to(output.dtype))
    if stash_owner is not None:
        impl, layer = stash_owner
        off = 0
        for tree, n in zip(ctx.plan.trees, batch.nodes):
            # index_select made fresh copies: slices stay valid after vLLM reuses its buffers
            ctx.kv_stash.append(StashedKV(impl, layer, kv_cache, tree.batch_index,
                                          k_tree[off:off + n], v_tree[off:off + n],
                                          slots[off:off + n]))
            off += n


def _torch_prefix_parts(q, kv_cache, block_table, batch: TreeBatch, cfg: HeadConfig):
    outs, lses, off = [], [], 0
    for b, n, p in zip(batch.requests, batch.nodes, batch.prefixes):
        # the root (position p) sees keys > p - window; blocks before that may be freed
        start = max(0, p - cfg.sliding_window + 1) if cfg.sliding_window > 0 else 0
        k_pre, v_pre = gather_prefix_flash(kv_cache, block_table[b], p, start)
        allowed = None
        if cfg.sliding_window > 0:
            allowed = window_allowed(batch.positions[off:off + n],
                                     torch.arange(start, p, device=q.device), cfg.sliding_window)
        o, lse = masked_attention(q[off:off + n], k_pre, v_pre, allowed, cfg.scale, cfg.softcap)
        outs.append(o)
        lses.append(lse)
        off += n
    return torch.cat(outs), torch.cat(lses)


def layer_reason(impl) -> str | None:
    """Why a FlashAttention layer's tree rows cannot be recomputed (None: they can)."""
    if impl.alibi_slopes is not None or impl.sinks is not None:
        return "ALiBi and attention sinks are not reproduced by the tree path"
    if impl.kv_cache_dtype not in _SUPPORTED_CACHE_DTYPES:
        return f"the tree path does not read a {impl.kv_cache_dtype!r} KV cache"
    if getattr(impl, "dcp_world_size", 1) > 1:
        return "decode context parallelism is not supported by the tree path"
    return None


def check_supported(impl, attn_metadata) -> None:
    """Refuses layer features the tree recompute does not reproduce (checked at load too).

    Raises:
        RuntimeError: see :func:`layer_reason`, or R-SWA metadata.
    """
    reason = layer_reason(impl)
    if reason is None and getattr(attn_metadata, "rswa_prefix_lens", None) is not None:
        reason = "R-SWA is not supported by the tree path"
    if reason is not None:
        raise RuntimeError(f"vllm-recap tree verification: {reason}; {_CHAIN_HINT}.")
