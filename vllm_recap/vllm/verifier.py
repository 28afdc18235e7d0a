"""After the forward: memory rows from the step's logits, and KV compaction of accepted trees.

(Tree acceptance itself is :mod:`vllm_recap.vllm.tree_verify`.)
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_recap.vllm.context import StashedKV, StepPlan

# Rows at least this wide are reduced chunk by chunk first (see topk_rows): on this CPU a plain
# torch.topk over a 262k-wide bf16 row costs several times the chunked form.
CHUNKED_FROM = 32768
CHUNK = 128


def topk_rows(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Memory rows: the top-K ids of each logits row and the softmax over those K logits.

    The one top-K function of the project (prompt seeding and verified steps). Wide rows are
    reduced in two passes that touch the vocabulary once: the maximum of every chunk of
    ``CHUNK`` logits, then a top-K over the K chunks with the highest maxima only -- exact,
    since each of the K largest logits is the maximum of its chunk or below one of the K
    largest chunk maxima. Ties keep ``torch.topk``'s order; rows only rank candidates.

    Args:
        logits: [R, V] (any float dtype, any device).
        k: ids kept per row (<= V).

    Returns:
        ids [R, K] int64 by logit descending, probs [R, K] float32 summing to 1 per row.
    """
    values, ids = _topk(logits, k)
    probs = torch.softmax(values.float(), dim=-1)
    return ids.cpu().numpy().astype(np.int64), probs.cpu().numpy()


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
    rule), in the rows' own dtype (no float32 copy), chunk maxima first for wide rows."""
    rows, vocab = logits.shape
    n_chunks = vocab // CHUNK
    if vocab < CHUNKED_FROM or n_chunks * CHUNK != vocab:
        return logits.float().argmax(dim=-1).cpu().numpy().astype(np.int64)
    body = logits.view(rows, n_chunks, CHUNK)
    chunk = body.amax(dim=-1).float().argmax(dim=-1)  # first chunk holding the maximum
    within = body[torch.arange(rows, device=logits.device), chunk].float().argmax(dim=-1)
    return (chunk * CHUNK + within).cpu().numpy().astype(np.int64)


def node_tokens_of_rows(plan: StepPlan, input_ids: torch.Tensor) -> np.ndarray:
    """[R] the input token at each logits row: the last 1 + drafts scheduled tokens of a request."""
    ends = plan.query_starts[1:]
    idx = np.concatenate([np.arange(e - (d + 1), e) for e, d in zip(ends, plan.num_drafts)])
    return input_ids[torch.from_numpy(idx).to(input_ids.device)].cpu().numpy().astype(np.int64)


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
        depth = np.arange(1, len(nodes) + 1)
        off = nodes != depth
        if off.any():
            moves[batch_index] = (nodes[off], depth[off])
    copies = 0
    for entry in stash:
        if entry.batch_index not in moves:
            continue
        src, dst = (torch.from_numpy(a).to(entry.slots.device) for a in moves[entry.batch_index])
        entry.writer.do_kv_cache_update(entry.layer, entry.key[src], entry.value[src],
                                        entry.kv_cache, entry.slots[dst])
        copies += 1
    return copies
