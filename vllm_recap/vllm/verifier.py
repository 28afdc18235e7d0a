"""After the forward: memory rows from the step's logits, and KV compaction of accepted trees.

(Tree acceptance itself is :mod:`vllm_recap.vllm.tree_verify`.)
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_recap.vllm.context import StashedKV, StepPlan

def topk_rows(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Memory rows: the top-K ids of each logits row and the softmax over those K logits.

    The one top-K function of the project (prompt seeding and verified steps). Ties keep
    ``torch.topk``'s order; rows only rank candidates, so ties need no rule of their own.

    Args:
        logits: [R, V] (any float dtype, any device).
        k: ids kept per row (<= V).

    Returns:
        ids [R, K] int64 by logit descending, probs [R, K] float32 summing to 1 per row.
    """
    values, ids = torch.topk(logits, k, dim=-1)
    probs = torch.softmax(values.float(), dim=-1)
    return ids.cpu().numpy().astype(np.int64), probs.cpu().numpy()


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
