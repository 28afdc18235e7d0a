"""What one engine step verifies: the batch's requests, their draft trees and logits rows.

Built by the runner seam right after vLLM prepared the step's inputs, read by the tree
attention backend during the forward pass, and by the verifier after it. Pure numpy: the
layout arithmetic is testable without an engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_recap.core.tree import tree_structure


@dataclass
class TreeSlot:
    """One request that verifies a (non-chain) tree this step.

    Attributes:
        batch_index: the request's row in vLLM's input batch.
        query_start: index of its first scheduled token (the root) in the flat token batch.
        parents: [n] parents of the verified nodes (root first, parents[0] = -1).
        depths: [n] node depths (root 0); a node's rotary position is root position + depth.
        ancestor_mask: [n, n] bool, mask[i, j] = node j is node i or one of its ancestors.
    """

    batch_index: int
    query_start: int
    parents: np.ndarray
    depths: np.ndarray
    ancestor_mask: np.ndarray
    torch_cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])


@dataclass
class StepPlan:
    """The verification layout of one engine step.

    Attributes:
        req_ids: [B] request ids in batch order.
        num_scheduled: [B] tokens scheduled per request.
        query_starts: [B + 1] cumulative token offsets (vLLM's query_start_loc).
        num_drafts: [B] draft tokens verified per request (0 for prefill / no draft).
        parents: per request, the [1 + num_drafts] parent array of its verified nodes.
        trees: the requests whose nodes are not a chain (need tree attention and acceptance).
        num_computed: [B] tokens already in the KV cache before this step.
        num_prompt: [B] prompt lengths.
        kv_stash: (impl, layer, kv_cache, batch_index, K [n, KVH, D], V, slots [n]) per tree
            request and attention layer, kept by the backend for KV compaction.
    """

    req_ids: list[str]
    num_scheduled: np.ndarray
    query_starts: np.ndarray
    num_drafts: np.ndarray
    parents: list[np.ndarray]
    trees: list[TreeSlot]
    num_computed: np.ndarray | None = None
    num_prompt: np.ndarray | None = None
    kv_stash: list = field(default_factory=list, repr=False)

    @property
    def logits_starts(self) -> np.ndarray:
        """[B + 1] offsets of each request's rows in the step's logits (1 + drafts each)."""
        return np.concatenate([[0], np.cumsum(self.num_drafts + 1)])

    def tree_by_batch_index(self) -> dict[int, TreeSlot]:
        return {t.batch_index: t for t in self.trees}


def chain_parents(n: int) -> np.ndarray:
    """[n] parents of a single path: -1, 0, 1, ..., n-2."""
    return np.arange(-1, n - 1, dtype=np.int64)


def build_plan(req_ids: list[str], num_scheduled: np.ndarray, query_starts: np.ndarray,
               scheduled_drafts: dict[str, list[int]], proposed_parents: dict[str, np.ndarray]
               ) -> StepPlan:
    """Lays out one step from the scheduler's drafts and the parents the proposer recorded.

    The scheduler may have truncated a request's draft list; because trees are laid out
    parents first, the kept prefix of the parent array is still a tree.

    Args:
        req_ids: [B] request ids in batch order.
        num_scheduled: [B] scheduled tokens per request.
        query_starts: [B + 1] flat-batch offsets.
        scheduled_drafts: request id -> draft tokens scheduled this step (absent = none).
        proposed_parents: request id -> [1 + drafts] parents recorded when proposing
            (absent = a chain).
    """
    num_drafts = np.zeros(len(req_ids), np.int64)
    parents: list[np.ndarray] = []
    trees: list[TreeSlot] = []
    for i, req_id in enumerate(req_ids):
        drafts = scheduled_drafts.get(req_id, ())
        n = 1 + len(drafts)
        num_drafts[i] = len(drafts)
        recorded = proposed_parents.get(req_id)
        if recorded is None or len(recorded) < n:
            p = chain_parents(n)
        else:
            p = np.asarray(recorded[:n], np.int64)
        parents.append(p)
        if n > 2 and not np.array_equal(p, chain_parents(n)):
            depths, _, mask = tree_structure(p)
            trees.append(TreeSlot(i, int(query_starts[i]), p, depths, mask))
    return StepPlan(list(req_ids), np.asarray(num_scheduled, np.int64),
                    np.asarray(query_starts, np.int64), num_drafts, parents, trees)


# The plan of the step being executed, for the attention backend (one engine step at a time
# per process; None outside the model forward of a step that verifies trees).
CURRENT: StepPlan | None = None
