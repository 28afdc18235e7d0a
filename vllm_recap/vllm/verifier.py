"""After the forward: memory rows from the step's logits, and KV compaction of accepted trees.

(Tree acceptance itself is :mod:`vllm_recap.vllm.tree_verify`.)
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_recap.core.topk import gather_floats, topk_bits, topk_probs
from vllm_recap.vllm.context import StashedKV, StepPlan

# Device rows (GPU) at least this wide are reduced chunk by chunk first (see _topk): a plain
# torch.topk over a 262k-wide row costs several times the chunked form.
CHUNKED_FROM = 32768
CHUNK = 128
# Row dtypes the compiled CPU kernel reads as integers (vllm_recap.core.topk).
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def topk_rows(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Memory rows: the top-K ids of each logits row and the softmax over those K logits.

    The one top-K function of the project (prompt seeding and verified steps). CPU rows go
    through :func:`vllm_recap.core.topk.topk_bits` (one compiled pass over the rows' bits,
    no thread pool; standalone, 17 bfloat16 rows of 49k: ~0.14 ms against 0.4-0.6 ms with
    torch, of 262k: ~0.37 ms against 1.5-2.8 ms -- in an engine step both also pay for
    reading rows the LM head just wrote); device rows through
    torch, chunk maxima first for wide rows. Both are exact; among equal logits the CPU
    kernel keeps the lower id first, torch its own order (rows only rank candidates).

    Args:
        logits: [R, V] (any float dtype, any device).
        k: ids kept per row (<= V).

    Returns:
        ids [R, K] int64 by logit descending, probs [R, K] float32 summing to 1 per row.
    """
    bits = _cpu_bits(logits)
    if bits is not None and logits.dtype != torch.float16:
        return topk_probs(bits, k, logits.dtype == torch.bfloat16)
    if bits is not None:
        ids, top = topk_bits(bits, k)
        values = torch.from_numpy(top).view(logits.dtype).float().numpy()
        e = np.exp(values - values[:, :1])  # largest first: a stable softmax over the K
        return ids, e / e.sum(axis=1, keepdims=True)
    values, ids = _topk(logits, k)
    probs = torch.softmax(values.float(), dim=-1)
    return ids.cpu().numpy().astype(np.int64), probs.cpu().numpy()


def rows_topk(logits: torch.Tensor, rows: np.ndarray, k: int
              ) -> tuple[np.ndarray, np.ndarray] | None:
    """The k largest logits of some CPU rows, by the compiled kernel (None for device rows).

    Args:
        logits: [R, V]; rows: [M] int64 row indices; k: entries per row (<= V).

    Returns:
        ids [M, k] int64 and values [M, k] float32, largest first (equal values: lower id).
    """
    bits = _cpu_bits(logits)
    if bits is None:
        return None
    ids, top = topk_bits(bits if len(rows) == len(bits) and
                         np.array_equal(rows, np.arange(len(bits))) else bits[rows], k)
    return ids, torch.from_numpy(top).view(logits.dtype).float().numpy()


def rows_values(logits: torch.Tensor, rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """[M, K] float32: entries ``ids`` [M, K] of logits rows ``rows`` [M] -- one compiled
    gather from the rows' bits on CPU (bfloat16 and float32 rows), a torch gather elsewhere
    (two small torch ops after the forward cost ~0.08 ms a step at batch 1, bf16 SmolLM2)."""
    bits = _cpu_bits(logits)
    if bits is not None and logits.dtype != torch.float16:
        return gather_floats(bits, rows, ids, logits.dtype == torch.bfloat16)
    dev = logits.device
    return logits[torch.from_numpy(np.asarray(rows, np.int64)).to(dev).unsqueeze(1),
                  torch.from_numpy(np.asarray(ids, np.int64)).to(dev)].float().cpu().numpy()


def top1_is_argmax(logits: torch.Tensor) -> bool:
    """True if :func:`topk_rows` of these logits puts each row's argmax by vLLM's rule (the
    lowest id among equal maxima) first: the CPU kernel does; torch's top-k on a device may
    order equal values otherwise."""
    return logits.dtype in _BITS and logits.device.type == "cpu" and logits.dim() == 2


def _cpu_bits(logits: torch.Tensor) -> np.ndarray | None:
    """[R, V] int16/int32 numpy view of CPU logits rows, None where the kernel does not apply."""
    if not top1_is_argmax(logits):
        return None
    return logits.contiguous().view(_BITS[logits.dtype]).numpy()


def _topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    n_chunks = vocab // CHUNK
    if vocab < CHUNKED_FROM or n_chunks < k:
        return torch.topk(logits, k, dim=-1)
    body = logits[:, :n_chunks * CHUNK].view(rows, n_chunks, CHUNK)
    best = body.amax(dim=-1).topk(k, dim=-1).indices  # [R, k] chunks holding the top k
    cand = body.gather(1, best[..., None].expand(-1, -1, CHUNK)).reshape(rows, k * CHUNK)
    cand_ids = (best[..., None] * CHUNK + torch.arange(CHUNK, device=logits.device)).reshape(
        rows, k * CHUNK)
    tail = vocab - n_chunks * CHUNK  # the last partial chunk is always a candidate
    if tail:
        cand = torch.cat([cand, logits[:, n_chunks * CHUNK:]], dim=1)
        cand_ids = torch.cat([cand_ids, torch.arange(n_chunks * CHUNK, vocab,
                                                     device=logits.device).expand(rows, -1)], 1)
    values, pos = cand.topk(k, dim=-1)
    return values, cand_ids.gather(1, pos)


def row_argmax(logits: torch.Tensor) -> np.ndarray:
    """[R] int64 argmax of each logits row, the lowest id among equal maxima (vLLM's greedy
    rule), in the rows' own dtype (no float32 copy): the compiled top-1 on CPU, chunk maxima
    first for wide device rows."""
    bits = _cpu_bits(logits)
    if bits is not None:
        return topk_bits(bits, 1)[0][:, 0]
    rows, vocab = logits.shape
    n_chunks = vocab // CHUNK
    if vocab < CHUNKED_FROM or n_chunks * CHUNK != vocab:
        return logits.float().argmax(dim=-1).cpu().numpy().astype(np.int64)
    body = logits.view(rows, n_chunks, CHUNK)
    chunk = body.amax(dim=-1).float().argmax(dim=-1)  # first chunk holding the maximum
    within = body[torch.arange(rows, device=logits.device), chunk].float().argmax(dim=-1)
    return (chunk * CHUNK + within).cpu().numpy().astype(np.int64)


def node_tokens_of_rows(plan: StepPlan, input_ids: np.ndarray) -> np.ndarray:
    """[R] the input token at each logits row: the last 1 + drafts scheduled tokens of a request.

    Args:
        plan: the step layout.
        input_ids: [T'] the host copy of the step's flat input ids (vLLM's ``input_ids.np``,
            a numpy view of its host buffer on every device; T' >= the step's tokens).

    Plain Python and numpy only: right after the forward pass the model's weights have
    flushed the caches, and every call runs cold (measured with ``benchmarks.proposer_profile
    --again``: 52 us cold against 10 us warm with a torch call in it); the array version
    (cumsum, repeat, arange) took ~100 us a step at batch 1.
    """
    ends = plan.query_starts.tolist()[1:]
    idx = [j for e, d in zip(ends, plan.num_drafts.tolist()) for j in range(e - d - 1, e)]
    return input_ids[idx].astype(np.int64)


def off_chain(nodes: np.ndarray) -> bool:
    """Whether accepted node indices (depth order, root excluded) leave the chain 1, 2, ...:
    plain Python, since numpy calls on a few numbers cost ~15 us right after the forward."""
    return nodes.tolist() != list(range(1, len(nodes) + 1))


def compact_kv(stash: list[StashedKV], accepted: dict[int, np.ndarray]) -> int:
    """Copies accepted off-chain nodes' K/V to the slots of their depth, in every layer.

    A node at index a verified at depth d was written at slot (root slot + a); after
    acceptance the sequence continues at root slot + d. Copies run in increasing depth, and a
    source index is never below its depth, so no copy overwrites a later source.

    Returns:
        The number of (request, layer) copies made.
    """
    moves: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for batch_index, nodes in accepted.items():
        if not off_chain(nodes):
            continue  # the chain's nodes: in place
        depth = np.arange(1, len(nodes) + 1)
        off = nodes != depth
        if off.any():
            moves[batch_index] = (nodes[off], depth[off])
    if not moves:
        return 0
    if stash and stash[0].key.device.type == "cpu":
        return _compact_cpu(stash, moves)
    copies = 0
    # Index tensors once per request and slot tensor, not per layer: the layers of a KV-cache
    # group share the step's slot mapping (the stash holds views of it in eager steps), and
    # ~30 layers x four small host ops were most of a compacting step's ~1.6 ms.
    index: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for entry in stash:
        move = moves.get(entry.batch_index)
        if move is None:
            continue
        key = (entry.batch_index, entry.slots.data_ptr(), entry.start)
        hit = index.get(key)
        if hit is None:
            src, dst = (torch.from_numpy(a + entry.start).to(entry.slots.device) for a in move)
            hit = index[key] = (src, entry.slots[dst])
        src, slots = hit
        entry.writer.do_kv_cache_update(entry.layer, entry.key[src], entry.value[src],
                                        entry.kv_cache, slots)
        copies += 1
    return copies


def _compact_cpu(stash: list[StashedKV], moves: dict[int, tuple[np.ndarray, np.ndarray]]
                 ) -> int:
    """:func:`compact_kv` on CPU: one cache write per layer, of the layer's stashed K/V rows
    as they are, with a slot mapping that is -1 (vLLM's padding slot: every CPU kernel's
    cache write skips it) except at the moved nodes' rows.

    Gathering each layer's moved rows first (two index ops, then the write) made
    compaction the largest piece of SmolLM2's slowest RECAP steps (1.1-1.8 ms over 30
    layers; float32, AVX2 EPYC) and the second of Gemma-3-270M's (0.7-1.2 ms over 18); this
    way a replayed compaction costs a third less. A layer's entries of several requests
    (eager steps stash the layer's whole tensors) share the one write."""
    # a layer's entries of the requests that moved a node, grouped by the tensors they share
    groups: dict[tuple[int, int, int], list[StashedKV]] = {}
    for entry in stash:
        if entry.batch_index in moves:
            groups.setdefault((id(entry.key), id(entry.slots), id(entry.kv_cache)),
                              []).append(entry)
    copies = 0
    mappings: dict[tuple, torch.Tensor] = {}
    for group in groups.values():
        first = group[0]
        # the layers of a KV-cache group share the step's slots: one mapping for all of them
        key = (first.slots.data_ptr(), first.key.shape[0],
               tuple((e.batch_index, e.start) for e in group))
        mapping = mappings.get(key)
        if mapping is None:
            rows = np.full(first.key.shape[0], -1, np.int64)
            slots = first.slots.numpy()
            for e in group:
                src, dst = moves[e.batch_index]
                rows[src + e.start] = slots[dst + e.start]
            mapping = mappings[key] = torch.from_numpy(rows)
        first.writer.do_kv_cache_update(first.layer, first.key, first.value, first.kv_cache,
                                        mapping)
        copies += len(group)
    return copies
