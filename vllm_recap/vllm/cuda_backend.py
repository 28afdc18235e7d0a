"""CUDA attention backend with per-request tree masks (registered over vLLM's FLASH_ATTN).

vLLM's FlashAttention kernel is causal over slot order; for a request verifying a tree, slot
order is the flattened tree, so a node would also see earlier siblings and cousins. As on CPU,
this backend runs the stock kernel for the whole batch (exact for prefill, decode and chains),
then recomputes the rows of tree requests: each node attends to the committed prefix (read from
the paged cache by FlashAttention itself, non-causal, ``seqused_k`` = prefix length, with the
rows' log-sum-exp) plus its ancestors and itself (a small float32 masked attention), and the
two parts are merged by log-sum-exp. All tree requests of a step go through one kernel call.
It keeps the nodes' K/V for KV compaction exactly like the CPU backend.

vLLM 0.33 (and 0.32) FlashAttention KV cache, per layer: a logical view
``[num_blocks, kv_heads, block_size, 2 * head_size]`` (K = first half of the last dim, V =
second half) whose strides follow the run's KV cache layout; FlashAttention reads it as
``kv_cache.transpose(1, 2).split(head_size, -1)``. Block ids and slots are in kernel blocks.

Layers with a sliding window take the prefix part in torch, over the window's tail only:
FlashAttention would place the tree queries at their slot positions, not at prefix + depth.

Full CUDA graphs would replay the stock kernel without running this Python, so the metadata
builder declares graph support only for single-token decode batches (which never hold a
tree); vLLM then falls back to piecewise graphs, where attention runs eagerly.

Only the pure-torch parts are imported at module import; the vLLM subclasses are built on first
attribute access (PEP 562), so this module imports on machines without vLLM's CUDA build.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm_recap.vllm.lse_merge import (
    merge_by_lse,
    prefix_attention_with_lse,
    tree_part_with_lse,
)

BACKEND_PATH = f"{__name__}.RecapFlashAttentionBackend"
_SUPPORTED_CACHE_DTYPES = ("auto", "float16", "bfloat16")
_CHAIN_HINT = "use speculative_config {'method': 'recap', 'draft_mode': 'chain'}"


def install_cuda_backend(vllm_config, register, enum) -> None:
    """Makes every decoder attention layer use :class:`RecapFlashAttentionBackend`.

    Tree rows are only correct on the backend that recomputes them, so instead of wrapping
    whatever vLLM would pick, the attention backend is pinned to FLASH_ATTN (vLLM's default on
    Ampere/Hopper) and that enum member is pointed at the tree-aware subclass.

    Args:
        vllm_config: the worker's ``VllmConfig`` (its ``attention_config`` is updated).
        register: vLLM's ``register_backend(backend, class_path)``.
        enum: vLLM's ``AttentionBackendEnum``.

    Raises:
        ValueError: the user asked for another attention backend.
    """
    attn = getattr(vllm_config, "attention_config", None)
    chosen = getattr(attn, "backend", None)
    per_kind = dict(getattr(attn, "backend_per_kind", None) or {})
    others = [b for b in [chosen, *per_kind.values()] if b is not None and b != enum.FLASH_ATTN]
    if others:
        names = ", ".join(getattr(b, "name", str(b)) for b in others)
        raise ValueError(
            f"vllm-recap tree verification on CUDA runs on the FLASH_ATTN attention backend, "
            f"but attention_config asks for {names} (set by attention_backend or by the model's "
            f"config). Use attention_backend FLASH_ATTN, or {_CHAIN_HINT}.")
    if attn is not None:
        attn.backend = enum.FLASH_ATTN  # the selector reads this before any priority list
    register(enum.FLASH_ATTN, BACKEND_PATH)


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


def tree_batch(plan, attn_metadata, device: torch.device) -> TreeBatch:
    """The step's :class:`TreeBatch`, cached on its first tree (a plan lives for one step)."""
    cache = plan.trees[0].torch_cache
    batch = cache.get("recap_cuda_batch")
    if batch is None:
        batch = cache["recap_cuda_batch"] = TreeBatch.build(plan.trees, attn_metadata, device)
    return batch


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


def recompute_tree_rows(cfg: HeadConfig, plan, query: torch.Tensor, key: torch.Tensor | None,
                        value: torch.Tensor | None, kv_cache: torch.Tensor, attn_metadata,
                        output: torch.Tensor, stash_owner: tuple | None = None) -> None:
    """Overwrites the output rows of every tree request with exact tree attention.

    Args:
        cfg: the layer's heads, scale, window, soft cap and FlashAttention version.
        plan: the step's ``StepPlan`` (``trees``, ``kv_stash``).
        query: [T, H, D]; key, value: [T, KVH, D] or None when a fused op already wrote them
            to the cache (then they are read back from their slots).
        kv_cache: the layer's FlashAttention cache, already holding this step's K/V.
        attn_metadata: vLLM's FlashAttentionMetadata (query_start_loc, seq_lens, block_table,
            slot_mapping).
        output: [T, H * D] or [T, H, D], written in place.
        stash_owner: (impl, layer) to stash the nodes' K/V for KV compaction; None = don't.
    """
    batch = tree_batch(plan, attn_metadata, query.device)
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
    o2, l2 = tree_part_with_lse(q, k_tree, v_tree, batch.mask, cfg.scale,
                                positions=batch.positions, sliding_window=cfg.sliding_window,
                                softcap=cfg.softcap)
    merged, _ = merge_by_lse(o1, l1, o2, l2)
    output.view(-1, h, d).index_copy_(0, batch.rows, merged.to(output.dtype))
    if stash_owner is not None:
        impl, layer = stash_owner
        off = 0
        for tree, n in zip(plan.trees, batch.nodes):
            # index_select made fresh copies: slices stay valid after vLLM reuses its buffers
            plan.kv_stash.append((impl, layer, kv_cache, tree.batch_index, k_tree[off:off + n],
                                  v_tree[off:off + n], slots[off:off + n]))
            off += n


def _torch_prefix_parts(q, kv_cache, block_table, batch: TreeBatch, cfg: HeadConfig):
    outs, lses, off = [], [], 0
    for b, n, p in zip(batch.requests, batch.nodes, batch.prefixes):
        # the root (position p) sees keys > p - window; blocks before that may be freed
        start = max(0, p - cfg.sliding_window + 1) if cfg.sliding_window > 0 else 0
        k_pre, v_pre = gather_prefix_flash(kv_cache, block_table[b], p, start)
        o, lse = prefix_attention_with_lse(
            q[off:off + n], k_pre, v_pre, cfg.scale,
            query_positions=batch.positions[off:off + n],
            key_positions=torch.arange(start, p, device=q.device),
            sliding_window=cfg.sliding_window, softcap=cfg.softcap)
        outs.append(o)
        lses.append(lse)
        off += n
    return torch.cat(outs), torch.cat(lses)


def check_supported(impl, attn_metadata) -> None:
    """Refuses layer features the tree recompute does not reproduce.

    Raises:
        RuntimeError: ALiBi, attention sinks, a quantized KV cache, decode context
            parallelism or R-SWA.
    """
    rswa = getattr(attn_metadata, "rswa_prefix_lens", None) is not None
    if impl.alibi_slopes is not None or impl.sinks is not None or rswa \
            or impl.kv_cache_dtype not in _SUPPORTED_CACHE_DTYPES \
            or getattr(impl, "dcp_world_size", 1) > 1:
        raise RuntimeError(
            "vllm-recap tree verification does not support ALiBi, attention sinks, a quantized "
            f"KV cache (kv_cache_dtype={impl.kv_cache_dtype!r}), decode context parallelism or "
            f"R-SWA; {_CHAIN_HINT}.")


@functools.cache
def _classes() -> dict[str, type]:
    from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
    from vllm.v1.attention.backends.flash_attn import (
        FlashAttentionBackend,
        FlashAttentionImpl,
        FlashAttentionMetadataBuilder,
    )

    from vllm_recap.vllm import step as step_mod

    class RecapFlashAttentionImpl(FlashAttentionImpl):
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                    output_scale=None, output_block_scale=None):
            output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                     output_scale, output_block_scale)
            plan = step_mod.CURRENT
            if plan is None or not plan.trees or attn_metadata is None \
                    or self.attn_type != AttentionType.DECODER:
                return output
            check_supported(self, attn_metadata)
            # a layer sharing another layer's cache has nothing of its own to compact
            owner = None if self.kv_sharing_target_layer_name is not None else (self, layer)
            recompute_tree_rows(HeadConfig.from_impl(self), plan, query, key, value, kv_cache,
                                attn_metadata, output, owner)
            return output

    class RecapFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
        _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

        @classmethod
        def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
            # full graphs only for 1-token decode batches: a tree batch must run forward()
            return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    class RecapFlashAttentionBackend(FlashAttentionBackend):
        @staticmethod
        def get_impl_cls():
            return RecapFlashAttentionImpl

        @staticmethod
        def get_builder_cls():
            return RecapFlashAttentionMetadataBuilder

    found = {c.__name__: c for c in (RecapFlashAttentionImpl, RecapFlashAttentionMetadataBuilder,
                                     RecapFlashAttentionBackend)}
    for name, c in found.items():
        # vLLM resolves the backend by f"{__module__}.{__qualname__}" (full_cls_name)
        c.__module__, c.__qualname__ = __name__, name
    return found


def __getattr__(name: str):
    if name.startswith("RecapFlashAttention"):
        classes = _classes()
        if name in classes:
            return classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
