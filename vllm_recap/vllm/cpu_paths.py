"""CPU tree attention inside vLLM's own kernel: one root-to-leaf path = one causal request.

vLLM's CPU kernel (``cpu_attention_with_kv_cache``) is causal per request, with no custom
mask. A tree is therefore split into paths, each verified as a *virtual request* of the same
kernel call. Path 0 is the best chain, which the builders lay out at indices 0..L, so its nodes
already sit at the real slots P..P+L (P = committed prefix length) and it reads the request's
own block table. Every node belongs to the first path containing it, so the nodes a path owns
are a suffix of it: the virtual request of path k has those nodes as queries and P + len(path)
as sequence length, so its query j sits at position P + depth -- the real position, which keeps
sliding windows exact. Its block table is its donor path's (ultimately the real prefix blocks),
then *scratch* blocks. The first is a whole-block copy of the request's real block holding the
prefix tail when P % bs > 0 (its first P % bs slots are the tail, then the tree's nodes in
layout order, so the path's leading path-0 nodes are in place too, whatever the ISA's in-block
layout); the path's other nodes are written by vLLM's own cache op.

Per step (:meth:`VirtualBatch.build`): the query permutation into path order, the virtual
query_start_loc / seq_lens / block table, the scratch copies and writes, and the kernel's
scheduler metadata. Per layer (:func:`forward_with_paths`): copy + write the scratch, permute
q, one kernel call for the whole batch, permute the output back. Requests without a tree keep
exactly the metadata vLLM built for them. A tree that finds too few scratch blocks stays one
(wrong, stock) request and its rows are recomputed densely, as the old path does.

Cost per layer over the stock kernel on a chain of as many tokens: the kernel on more, shorter
requests (+0-8%), one block copy per path that starts in the tail block (so proportional to the
block size: bs = 32 copies a quarter of vLLM's default 128 at the same kernel speed), and about
ten small torch ops. ``benchmarks/cpu_tree_attention_cost.py`` measures it.

Wiring, in ``RecapCPUAttentionImpl.forward`` when :meth:`tree_step` returns a context::

    vb = step_virtual_batch(ctx, attn_metadata, kv_cache.shape[2], scratch_block_ids)
    return forward_with_paths(self, layer, query, key, value, kv_cache, attn_metadata, vb,
                              output, ctx)
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from vllm_recap.vllm.attention_math import tree_attention
from vllm_recap.vllm.context import StashedKV, StepContext, StepPlan
from vllm_recap.vllm.kv_layout import probe_layout


@dataclass(frozen=True)
class PathSplit:
    """A parents-first tree as root-to-leaf paths, path 0 being the layout chain 0..L.

    Plain tuples: trees are small and this is built per tree per step, where numpy's
    per-call cost would dominate.

    Attributes:
        nodes: per path, its node indices from the root (path 0: 0..L).
        shared: per path, the nodes it shares with earlier paths (0 for path 0, else >= 1);
            the path owns ``nodes[k][shared[k]:]``.
        donor: per path, the path owning node ``nodes[k][shared[k] - 1]`` (-1 for path 0); its
            first ``shared[k]`` nodes are path k's.
        on_chain: per path, how many leading nodes are path 0's (node d at depth d): those
            already sit at their path positions in the request's real slots.
        order: the owned nodes of path 0, path 1, ... (each of the n nodes once).
    """

    nodes: tuple[tuple[int, ...], ...]
    shared: tuple[int, ...]
    donor: tuple[int, ...]
    on_chain: tuple[int, ...]
    order: tuple[int, ...]


def split_paths(parents: np.ndarray) -> PathSplit:
    """Splits a tree into paths: path 0 = the longest prefix chain 0..L, then one path per
    remaining leaf in ascending index order (deterministic; a node is owned by the first path
    that contains it). Splits are kept per tree shape (small trees repeat from step to step;
    a split is immutable).

    Raises:
        ValueError: ``parents`` is not a parents-first tree (parents[0] = -1, parents[i] < i).
    """
    par = np.asarray(parents).tolist()
    return _split_shape(tuple(par) if isinstance(par, list) else ())


@functools.lru_cache(maxsize=4096)
def _split_shape(par: tuple[int, ...]) -> PathSplit:
    n = len(par)
    if n == 0 or par[0] != -1 or any(not 0 <= p < i for i, p in enumerate(par) if i):
        raise ValueError(f"parents must be a parents-first tree, got {par}")
    last = 0  # L
    while last + 1 < n and par[last + 1] == last:
        last += 1
    owner = [0] * (last + 1) + [-1] * (n - last - 1)
    has_child = [False] * n
    for p in par[1:]:
        has_child[p] = True
    nodes, shared, donor, on_chain = [tuple(range(last + 1))], [0], [-1], [last + 1]
    for leaf in range(last + 1, n):
        if has_child[leaf]:
            continue
        path = [leaf]
        while path[-1] != 0:
            path.append(par[path[-1]])
        path.reverse()
        first_owned = next(d for d, v in enumerate(path) if owner[v] < 0)  # a suffix
        for v in path[first_owned:]:
            owner[v] = len(nodes)
        donor.append(owner[path[first_owned - 1]])
        on_chain.append(next(d for d, v in enumerate(path) if v != d))
        nodes.append(tuple(path))
        shared.append(first_owned)
    order = tuple(v for p, s in zip(nodes, shared) for v in p[s:])
    return PathSplit(tuple(nodes), tuple(shared), tuple(donor), tuple(on_chain), order)


def path_block_spans(split: PathSplit, prefix_len: int, block_size: int) -> list[range]:
    """Per path k >= 1, the logical block indices that need scratch blocks.

    A path's blocks before the one holding its first owned node (position P + shared[k]) are
    its donor's, so the span is ``(P + shared[k]) // bs ..= (P + len_k - 1) // bs``.
    """
    return [range((prefix_len + s) // block_size, (prefix_len + len(p) - 1) // block_size + 1)
            for p, s in zip(split.nodes[1:], split.shared[1:])]


def scratch_blocks_needed(parents: np.ndarray, prefix_len: int, block_size: int) -> int:
    """Scratch blocks one tree request needs in a step (the same ids serve every layer).

    Path k >= 1 needs the blocks its owned nodes (positions P + shared_k .. P + len_k - 1)
    touch: ``1 + (P + len_k - 1) // bs - (P + shared_k) // bs``; its earlier blocks are its
    donor's. That is one block, or two when the owned nodes straddle a block end (owned <=
    bs), so a tree needs at most ``2 * (paths - 1)`` blocks, and paths - 1 <= leaves <=
    n - 1 - L. A chain needs none. The block holding the prefix tail is copied once per path
    that starts in it (P % bs > 0), whole: with vLLM's default bs = 128 that is up to 128
    tokens of K/V per path and layer, with bs = 32 at most 32 (same kernel speed).
    """
    split = split_paths(parents)
    return sum(len(r) for r in path_block_spans(split, prefix_len, block_size))


@dataclass(frozen=True)
class _DenseTree:
    """A tree that got no scratch: recomputed densely after the kernel (the old CPU path)."""

    batch_index: int
    query_start: int
    prefix: int
    mask: torch.Tensor  # [n, n] bool ancestor mask
    positions: torch.Tensor  # [n] int64, P + depth


@dataclass(frozen=True)
class _TailCopy:
    """One tree's copies of its real tail block (prefix tail, then the nodes in layout order).

    Whole blocks, whatever the ISA's in-block layout. One ``copy_`` when the destinations are
    consecutive ids (measured 3-4x faster than ``index_copy_``: it never materialises the
    source), else ``index_copy_`` from the broadcast source block.
    """

    src: int
    dst: torch.Tensor  # [m] int64 scratch block ids
    first: int  # dst[0] if dst is dst[0], dst[0] + 1, ..., else -1


@dataclass(frozen=True)
class VirtualBatch:
    """One step's batch as the kernel sees it: every tree request split into path requests.

    Build once per step and KV-cache group (:meth:`build`), use in every layer of the group.

    Attributes:
        block_size: the kernel block size the block tables and slots are in.
        perm: [N] int64, row j of the virtual batch is row perm[j] of vLLM's batch.
        identity: perm is the identity (no tree has a path beyond path 0 reordered).
        query_start_loc: [R + 1] int32 virtual requests' query offsets.
        seq_lens: [R] int32 virtual sequence lengths.
        block_table: [R, W] int32 virtual block tables (real rows for non-tree requests).
        tail_copies: per tree with a partial prefix block, its copies into scratch.
        write_rows: [M] int64 rows of vLLM's key/value written into scratch after the copies.
        write_first: write_rows[0] when they are the run write_rows[0], write_rows[0] + 1, ...
            (read with narrow(), no copy: the usual case in the depth-first layout), else -1.
        write_slots: [M] int64 their scratch slots.
        dense: trees without scratch, recomputed densely.
        stash: (batch index, query start, nodes) of every tree request, for KV compaction.
        scratch_used: scratch blocks this step uses.
    """

    block_size: int
    perm: torch.Tensor
    identity: bool
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    tail_copies: tuple[_TailCopy, ...]
    write_rows: torch.Tensor
    write_first: int
    write_slots: torch.Tensor
    dense: tuple[_DenseTree, ...]
    stash: tuple[tuple[int, int, int], ...]
    scratch_used: int
    _schedules: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, plan: StepPlan, attn_metadata: Any, block_size: int,
              scratch_block_ids: list[int] | np.ndarray) -> VirtualBatch:
        """Args:
            plan: the step's layout (``plan.trees`` are split; other requests kept as is).
            attn_metadata: vLLM's ``CPUAttentionMetadata`` of this step and cache group.
            block_size: the kernel block size of the group (``kv_cache.shape[2]``, the unit
                of ``attn_metadata.block_table`` and of the scratch ids).
            scratch_block_ids: free block ids of the group's caches, never handed out by
                vLLM's block pool, best a run of consecutive ids (one copy per tree and
                layer); trees are served in batch order while they last (see
                :func:`scratch_blocks_needed`), later trees fall back to the dense path.
        """
        bs = int(block_size)
        qsl = attn_metadata.query_start_loc.tolist()
        seq_lens = attn_metadata.seq_lens.tolist()
        num_reqs = len(seq_lens)
        real_bt = attn_metadata.block_table[:num_reqs].numpy()
        free = np.asarray(scratch_block_ids, np.int64).reshape(-1)
        used = 0
        trees = plan.tree_by_batch_index()
        v_qlen, v_seq, v_rows = [], [], []
        perm: list[tuple[int, int, tuple[int, ...] | None]] = []  # (qs, qe, order or in place)
        copies, w_rows, w_slots = [], [], []
        dense, stash = [], []
        for i in range(num_reqs):
            qs, qe = qsl[i], qsl[i + 1]
            tree = trees.get(i)
            if tree is None:
                v_qlen.append(qe - qs)
                v_seq.append(seq_lens[i])
                v_rows.append(real_bt[i])
                perm.append((qs, qe, None))
                continue
            n = tree.num_nodes
            if qe - qs != n:
                raise ValueError(f"tree request {i}: {qe - qs} scheduled tokens, {n} tree nodes")
            prefix = seq_lens[i] - n
            stash.append((i, qs, n))
            split = split_paths(tree.parents)
            spans = path_block_spans(split, prefix, bs)
            need = sum(len(r) for r in spans)
            if used + need > free.shape[0]:
                dense.append(_DenseTree(i, qs, prefix, torch.from_numpy(tree.ancestor_mask),
                                        torch.from_numpy(tree.depths + prefix)))
                v_qlen.append(n)
                v_seq.append(seq_lens[i])
                v_rows.append(real_bt[i])
                perm.append((qs, qe, None))
                continue
            tail_block = prefix // bs if prefix % bs else -1
            copied = [r.start == tail_block for r in spans]
            # the copied blocks first: consecutive ids when the caller's are
            copy_ids = free[used:used + sum(copied)]
            rest = iter(free[used + len(copy_ids):used + need].tolist())
            used += need
            copy_iter = iter(copy_ids.tolist())
            rows = [real_bt[i]]
            for k, span in enumerate(spans, start=1):
                ids = [next(copy_iter) if copied[k - 1] else next(rest)] + \
                    [next(rest) for _ in range(len(span) - 1)]
                row = rows[split.donor[k]].copy()
                row[span.start:span.stop] = ids
                rows.append(row)
                first = span.start * bs
                # the copied block holds path 0's nodes at their path positions already
                skip = prefix + split.on_chain[k] if copied[k - 1] else first
                for d, v in enumerate(split.nodes[k]):
                    pos = prefix + d
                    if pos >= first and (pos >= skip or pos >= first + bs):
                        w_rows.append(qs + v)
                        w_slots.append(ids[pos // bs - span.start] * bs + pos % bs)
            if len(copy_ids):
                copies.append(_TailCopy(int(real_bt[i][tail_block]), torch.from_numpy(copy_ids),
                                        _run_start(copy_ids.tolist())))
            v_rows.extend(rows)
            v_qlen.extend(len(p) - int(s) for p, s in zip(split.nodes, split.shared))
            v_seq.extend(prefix + len(p) for p in split.nodes)
            perm.append((qs, qe, None if split.order == tuple(range(n)) else split.order))
        # Plain Python on a few numbers, numpy/torch once each (this runs once per step, but
        # right after vLLM's input preparation, where each small numpy call costs 10-20 us).
        # Requests' query runs are consecutive (query_start_loc), so only trees reorder.
        identity = all(order is None for _, _, order in perm)
        if identity:
            perm_t = torch.arange(qsl[num_reqs], dtype=torch.int64)
        else:
            perm_t = torch.tensor([j for qs, qe, order in perm for j in (
                range(qs, qe) if order is None else (qs + v for v in order))],
                dtype=torch.int64)

        return cls(
            block_size=bs, perm=perm_t, identity=identity,
            query_start_loc=torch.tensor([0, *itertools.accumulate(v_qlen)],
                                         dtype=torch.int32),
            seq_lens=torch.tensor(v_seq, dtype=torch.int32),
            block_table=torch.from_numpy(np.stack(v_rows).astype(np.int32, copy=False)),
            tail_copies=tuple(copies), write_rows=torch.tensor(w_rows, dtype=torch.int64),
            write_first=_run_start(w_rows),
            write_slots=torch.tensor(w_slots, dtype=torch.int64),
            dense=tuple(dense), stash=tuple(stash), scratch_used=used)

    @property
    def num_requests(self) -> int:
        return int(self.seq_lens.shape[0])

    def scheduler_metadata(self, impl: Any, dtype: torch.dtype, isa: str) -> torch.Tensor:
        """The kernel's work partition for this batch, built once per distinct layer shape.

        vLLM's builder passes the window shared by all layers of the group (else -1) and
        ``VLLM_CPU_ATTN_SPLIT_KV``. The window there only bounds which KV positions the work
        items cover (the kernel masks by the layer's own window), so each layer's own window
        is exact too and prunes as tightly; layers of one shape share the result.
        """
        key = (impl.num_heads, impl.num_kv_heads, impl.head_size, impl.sliding_window, dtype,
               isa, impl.kv_cache_dtype)
        sched = self._schedules.get(key)
        if sched is None:
            from vllm import envs

            sched = _vllm_ops().cpu_attn_get_scheduler_metadata(
                num_reqs=self.num_requests, num_heads=impl.num_heads,
                num_kv_heads=impl.num_kv_heads, head_dim=impl.head_size,
                seq_lens=self.seq_lens, dtype=dtype, query_start_loc=self.query_start_loc,
                causal=True, sliding_window_size=impl.sliding_window, isa=isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=impl.kv_cache_dtype)
            self._schedules[key] = sched
        return sched


class PathsState:
    """``ctx.backend_state`` of the path backend: one :class:`VirtualBatch` per KV-cache
    group (per attention-metadata object) of the step.

    Every layer of a tree step asks for its group's batch: a scan by identity over the
    step's few groups (usually one), with the scratch ids asked for only when a batch is
    built (a dict lookup plus the ids cost ~14 us a layer right after the linear layers).
    """

    def __init__(self) -> None:
        self._batches: list[tuple[Any, VirtualBatch]] = []

    def get(self, ctx: StepContext, attn_metadata: Any, block_size: int,
            scratch_block_ids: Callable[[], Sequence[int] | np.ndarray]
            | Sequence[int] | np.ndarray) -> VirtualBatch:
        for metadata, batch in self._batches:
            if metadata is attn_metadata:
                return batch
        ids = scratch_block_ids() if callable(scratch_block_ids) else scratch_block_ids
        batch = VirtualBatch.build(ctx.plan, attn_metadata, block_size, ids)
        self._batches.append((attn_metadata, batch))
        return batch


def step_virtual_batch(ctx: StepContext, attn_metadata: Any, block_size: int,
                       scratch_block_ids: Callable[[], Sequence[int] | np.ndarray]
                       | Sequence[int] | np.ndarray) -> VirtualBatch:
    """The step's virtual batch for this cache group, built by the first layer that asks.

    ``scratch_block_ids``: the group's scratch ids, or a function returning them (called only
    when the batch is built).
    """
    state = ctx.backend_state
    if state.__class__ is not PathsState:
        state = ctx.backend_state = PathsState()
    return state.get(ctx, attn_metadata, block_size, scratch_block_ids)


def forward_with_paths(impl: Any, layer: Any, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any,
                       vb: VirtualBatch, output: torch.Tensor, ctx: StepContext
                       ) -> torch.Tensor:
    """Decoder self-attention of a step with trees, in place of ``CPUAttentionBackendImpl
    .forward`` (vLLM has already written every scheduled token's K/V to its real slot).

    Args:
        impl: the layer's ``CPUAttentionBackendImpl`` (scale, window, softcap, sinks...).
        layer: the attention layer (``isa``, K/V scales).
        query: [T, H, D]; key, value: [T, KVH, D] (T >= N = scheduled tokens).
        kv_cache: [num_blocks, KVH, block_size, 2 * D], the scratch blocks included.
        attn_metadata: vLLM's metadata of the step (real requests).
        vb: the step's virtual batch for this cache group.
        output: [T, H * D] or [T, H, D], rows 0..N-1 written.
        ctx: the step context; one ``StashedKV`` per tree request is appended.

    Returns:
        ``output``.
    """
    ops = _vllm_ops()
    n_tok = int(vb.perm.shape[0])
    if kv_cache.shape[2] != vb.block_size:
        raise ValueError(f"virtual batch built for block size {vb.block_size}, cache has "
                         f"{kv_cache.shape[2]}")
    # Per layer, every Python-level tensor op costs a few us (more right after the linear
    # layers have streamed their weights): ~30 layers x ~10 ops were a tree pass's fixed extra
    # cost over a chain's. Hence narrow() for slices, cached cache views, stash without slices.
    key_cache, value_cache = _split_cache(impl, kv_cache)
    for c in vb.tail_copies:  # before the writes: they overwrite the copied nodes
        src = kv_cache.narrow(0, c.src, 1)
        if c.first >= 0:
            kv_cache.narrow(0, c.first, c.dst.shape[0]).copy_(src)  # broadcast from one block
        else:
            kv_cache.index_copy_(0, c.dst, src.expand(c.dst.shape[0], -1, -1, -1))
    m = vb.write_rows.shape[0]
    if m:
        if vb.write_first >= 0:  # vLLM's own cache write reads such strided views too
            k, v = key.narrow(0, vb.write_first, m), value.narrow(0, vb.write_first, m)
        else:
            k, v = key.index_select(0, vb.write_rows), value.index_select(0, vb.write_rows)
        ops.cpu_attn_reshape_and_cache(
            k, v, key_cache, value_cache, vb.write_slots, layer.isa, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, kv_cache_dtype=impl.kv_cache_dtype)
    if impl.sinks is not None and impl.sinks.dtype not in (torch.bfloat16, torch.float32):
        impl.sinks = impl.sinks.to(torch.float32)  # as vLLM's forward: the kernel's dtypes
    out3 = output.view(output.shape[0], impl.num_heads, impl.head_size)
    rows = out3 if out3.shape[0] == n_tok else out3.narrow(0, 0, n_tok)
    if vb.identity:
        q, out = (query if query.shape[0] == n_tok else query.narrow(0, 0, n_tok)), rows
    else:  # the kernel reads each request's queries as one contiguous run of rows
        q = query.index_select(0, vb.perm)
        out = torch.empty_like(rows)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=vb.query_start_loc, seq_lens=vb.seq_lens, scale=impl.scale,
        causal=True, alibi_slopes=impl.alibi_slopes, sliding_window=impl.sliding_window,
        block_table=vb.block_table, softcap=impl.logits_soft_cap,
        scheduler_metadata=vb.scheduler_metadata(impl, query.dtype, layer.isa),
        s_aux=impl.sinks, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
        kv_cache_dtype=impl.kv_cache_dtype)
    if not vb.identity:
        rows.index_copy_(0, vb.perm, out)
    if vb.dense:
        _recompute_dense(impl, layer, query, key, value, kv_cache, attn_metadata, vb, out3)
    # The layer's own tensors where the step allows (three copies per tree and layer cost
    # ~25-45 us of a ~100-400 us layer, bf16 SmolLM2 shapes); slots are the step's own, read
    # before the next step's metadata.
    slots = attn_metadata.slot_mapping
    for batch_index, qs, n in vb.stash:
        if ctx.kv_views:
            entry = StashedKV(impl, layer, kv_cache, batch_index, key, value, slots, qs)
        else:
            entry = StashedKV(impl, layer, kv_cache, batch_index, key[qs:qs + n].clone(),
                              value[qs:qs + n].clone(), slots[qs:qs + n].clone())
        ctx.kv_stash.append(entry)
    return output


def _split_cache(impl: Any, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's key and value views of a layer's cache [NB, KVH, bs, 2D], kept on the
    layer's implementation for the cache tensor they were made of (vLLM allocates each
    layer's cache once, so they are made once)."""
    hit = getattr(impl, "_recap_cache_views", None)
    if hit is not None and hit[0] is kv_cache:
        return hit[1], hit[2]
    nb, kvh, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, kvh, 2 * bs, -1).chunk(2, dim=2)
    impl._recap_cache_views = (kv_cache, key_cache, value_cache)
    return key_cache, value_cache


def _run_start(values: list[int]) -> int:
    """values[0] when values are values[0], values[0] + 1, ... (one narrow() / copy_), else -1."""
    if values and values == list(range(values[0], values[0] + len(values))):
        return values[0]
    return -1


@functools.lru_cache(maxsize=1)
def _vllm_ops():
    from vllm import _custom_ops

    return _custom_ops


def _recompute_dense(impl, layer, query, key, value, kv_cache, attn_metadata, vb, out3):
    """The trees without scratch: prefix read back from the cache, masked attention."""
    _, _, bs, two_hs = kv_cache.shape
    layout = probe_layout(kv_cache.dtype, bs, two_hs // 2, layer.isa)
    for t in vb.dense:
        qs, n = t.query_start, int(t.mask.shape[0])
        k_pre, v_pre = layout.gather(kv_cache, attn_metadata.block_table[t.batch_index],
                                     t.prefix)
        out3[qs:qs + n] = tree_attention(
            query[qs:qs + n], k_pre, v_pre, key[qs:qs + n], value[qs:qs + n], t.mask,
            impl.scale, node_positions=t.positions, sliding_window=impl.sliding_window,
            softcap=float(impl.logits_soft_cap or 0.0))
