"""Sampling seam: memory rows from the step's logits, greedy tree acceptance, KV compaction.

vLLM's rejection sampler only knows chains. For a request that verified a tree, this replaces
its output row with the greedy tree acceptance, in vLLM's own layout ``[batch, max_spec + 1]``
padded with -1 (accepted path tokens, then the bonus token), so the scheduler, bookkeeping and
spec-decode metrics work unchanged. Chains and sampled requests keep vLLM's result.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_recap.core.verify import verify_greedy
from vllm_recap.vllm.context import StashedKV, StepPlan

PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID for rejected positions


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


def tree_argmax(plan: StepPlan, logits: torch.Tensor) -> np.ndarray:
    """The target's greedy choice at every node of the step's tree requests, concatenated.

    Read before vLLM's sampler runs: it may process logits in place.
    """
    if not plan.trees:
        return np.zeros(0, np.int64)
    starts = plan.logits_starts
    rows = np.concatenate([np.arange(starts[t.batch_index], starts[t.batch_index] + t.num_nodes)
                           for t in plan.trees])
    return logits[torch.from_numpy(rows).to(logits.device)].argmax(dim=-1).cpu().numpy()


def accept_trees(plan: StepPlan, argmax: np.ndarray, node_tokens: np.ndarray,
                 sampled: torch.Tensor) -> dict[int, np.ndarray]:
    """Overwrites tree requests' rows of ``sampled`` with their greedy tree acceptance.

    Args:
        plan: the step layout.
        argmax: [sum of tree sizes] from :func:`tree_argmax`.
        node_tokens: [R] tokens of the evaluated nodes (all requests).
        sampled: [B, max_spec + 1] vLLM's sampler output, modified in place.

    Returns:
        batch index -> accepted node indices (depth order, root excluded) for tree requests.
    """
    starts = plan.logits_starts
    accepted: dict[int, np.ndarray] = {}
    offset = 0
    out = torch.full_like(sampled[0], PLACEHOLDER)
    for tree in plan.trees:
        n = tree.num_nodes
        s = starts[tree.batch_index]
        tokens = node_tokens[s:s + n]
        nodes, bonus = verify_greedy(tokens, tree.parents, argmax[offset:offset + n])
        offset += n
        row = out.clone()
        path = [int(t) for t in tokens[nodes]] + [int(bonus)]
        row[:len(path)] = torch.tensor(path, dtype=row.dtype)
        sampled[tree.batch_index] = row
        accepted[tree.batch_index] = np.asarray(nodes, np.int64)
    return accepted


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
