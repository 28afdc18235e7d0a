"""Laying out one step: which scheduled drafts form trees, and where their nodes sit.

The scheduler treats every request's drafts as a chain and may cut them to a prefix. The
proposer recorded the full tree it drafted; a scheduled draft list that is a prefix of that
tree's draft tokens verifies as the tree's first nodes (parents come first, so every prefix is
a tree). Anything else -- no recorded tree, or drafts that are not what was proposed -- verifies
as a chain, which is always exact. That rule depends only on what vLLM scheduled, so every
tensor-parallel rank lays the step out identically.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch

from vllm_recap.core.tree import DraftTree, ancestor_mask
from vllm_recap.vllm.context import StepPlan, TreeSlot


def chain_parents(n: int) -> np.ndarray:
    """[n] parents of a single path: -1, 0, 1, ..., n-2 (read-only, shared)."""
    return _chain_arrays(n)[0]


@functools.lru_cache(maxsize=256)
def _chain_arrays(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A single path of n nodes: [n] parents, [n] depths and its [n, n] ancestor mask, built
    once per n and read-only. Every step lays out a chain or a lone root per request that
    drafts no tree; building them anew (``np.tri`` most) made ``whole_step_slots`` cost
    0.134 ms a step at concurrency 16, 0.016-0.019 ms with these (``proposer_profile``,
    Intel Xeon AVX-512, bf16 SmolLM2)."""
    arrays = (np.arange(-1, n - 1, dtype=np.int64), np.arange(n, dtype=np.int64),
              np.tri(n, dtype=bool))
    for a in arrays:
        a.setflags(write=False)
    return arrays


def build_plan(req_ids: Sequence[str], num_scheduled: np.ndarray, query_starts: np.ndarray,
               scheduled_drafts: Mapping[str, Sequence[int]],
               proposals: Mapping[str, DraftTree], num_computed: np.ndarray,
               num_prompt: np.ndarray) -> StepPlan:
    """Lays out one step from the scheduler's drafts and the trees the proposer recorded.

    Args:
        req_ids: [B] request ids in batch order.
        num_scheduled: [B] scheduled tokens per request.
        query_starts: [B + 1] flat-batch offsets.
        scheduled_drafts: request id -> draft tokens scheduled this step (absent = none).
        proposals: request id -> the full tree proposed for this step (absent = none).
        num_computed: [B] tokens in the KV cache before this step.
        num_prompt: [B] prompt lengths.
    """
    num_drafts = np.zeros(len(req_ids), np.int64)
    parents: list[np.ndarray] = []
    trees: list[TreeSlot] = []
    for i, req_id in enumerate(req_ids):
        drafts = scheduled_drafts.get(req_id, ())
        n = 1 + len(drafts)
        num_drafts[i] = len(drafts)
        tree = proposals.get(req_id)
        if tree is None or not _is_prefix(drafts, tree):
            parents.append(chain_parents(n))
            continue
        p = tree.parents[:n]
        parents.append(p)
        if n > 2 and not np.array_equal(p, chain_parents(n)):
            trees.append(TreeSlot(i, int(query_starts[i]), p, tree.depths[:n], ancestor_mask(p)))
    return StepPlan(list(req_ids), np.asarray(num_scheduled, np.int64),
                    np.asarray(query_starts, np.int64), num_drafts, parents, trees,
                    np.asarray(num_computed, np.int64), np.asarray(num_prompt, np.int64))


def whole_step_slots(plan: StepPlan) -> list[TreeSlot]:
    """Every request of the step as a slot RECAP verifies, in batch order: its tree's slot, or
    a chain slot of its root and drafts (a root alone without drafts). For a step of decodes
    only (``num_scheduled == 1 + num_drafts`` for every request, as the caller checks)."""
    return slots_with_chains(plan, range(len(plan.req_ids)))


def slots_with_chains(plan: StepPlan, chains: Iterable[int]) -> list[TreeSlot]:
    """The step's tree slots plus a chain slot (root and drafts) for each batch row in
    ``chains`` without a tree, in batch order: the requests whose acceptance RECAP decides.
    Each row in ``chains`` must be a decode (its scheduled tokens are its root and drafts)."""
    trees = plan.tree_by_batch_index()
    starts, drafts = plan.query_starts.tolist(), plan.num_drafts.tolist()
    for i in chains:
        if i not in trees:
            trees[i] = TreeSlot(i, starts[i], *_chain_arrays(1 + drafts[i]))
    return [trees[i] for i in sorted(trees)]


def as_scheduled(tree: DraftTree, laid: DraftTree | None, drafts: Sequence[int]) -> DraftTree:
    """The proposal as its scheduled drafts were sent.

    The proposer sends the first n nodes of ``tree`` (n = drafts scheduled) in depth-first
    order (`DraftTree.depth_first`), or the first n nodes of its first path
    (`DraftTree.first_path`: the budget found the chain cheaper). The first of the two whose
    tokens are the drafts is the layout, so a chain whose tokens happen to equal the subtree's
    is verified as the subtree (exact either way); ``tree`` itself when neither is
    (``build_plan`` then checks the drafts against its prefix, else verifies them as a chain).

    Every tensor-parallel rank records the same full tree but sends its own count and shape:
    the layout is derived from what was scheduled alone (``laid``, this rank's own, only saves
    that work when it is the subtree of that count).

    Args:
        tree: the full proposal.
        laid: the laid-out drafts this rank sent, if any.
        drafts: [n] the draft tokens vLLM scheduled.
    """
    n = len(drafts)
    if n < 2:
        return tree
    ours = laid is not None and laid.num_drafts == n
    # The usual step: this rank's own subtree went out as laid. (A laid chain still takes the
    # checks below: a subtree with the same tokens comes first, on every rank.) Plain Python
    # lists: numpy calls on a few numbers cost 10-20 us each right after the forward pass.
    if ours and laid.chain_len < n and laid.draft_tokens.tolist() == list(drafts):
        return laid
    want = np.asarray(drafts, np.int64)
    # the subtree holds the tree's first n drafts in another order: unless the drafts are
    # those tokens, it cannot be what was sent (skips laying it out for most chains)
    if sorted(want.tolist()) == sorted(tree.tokens[1:1 + n].tolist()):
        subtree = laid if ours and not laid.is_chain() else tree.truncate(1 + n).depth_first()
        if subtree.num_drafts == n and np.array_equal(subtree.draft_tokens, want):
            return subtree
    path = laid if ours and laid.is_chain() else tree.first_path().truncate(1 + n)
    if path.num_drafts == n and np.array_equal(path.draft_tokens, want):
        return path
    return tree


def _is_prefix(drafts: Sequence[int], tree: DraftTree) -> bool:
    n = len(drafts)
    return n <= tree.num_drafts and tree.tokens[1:1 + n].tolist() == list(drafts)


def rewrite_positions(positions: torch.Tensor, mrope_positions: torch.Tensor | None,
                      plan: StepPlan) -> None:
    """Tree node i gets rotary position (root position + depth_i), not root position + i.

    Slots (the slot mapping, already computed by vLLM) stay linear: each node keeps its own
    KV slot. M-RoPE models read ``mrope_positions``; tree nodes are text tokens, so all its
    sections move by the depth. The index arrays are built on the host and copied to the
    position tensors' device once, so this works on any device.

    Args:
        positions: [T] the runner's rotary positions (any device), modified in place.
        mrope_positions: [3, >= T] M-RoPE positions or None, modified in place.
        plan: the step layout (only tree requests move).
    """
    if not plan.trees:
        return
    if positions.device.type == "cpu":
        # In place through numpy views: the torch index ops below cost ~0.1 ms a step on
        # a 2-core CPU right after the forward pass, these few us.
        for target in (positions, mrope_positions):
            if target is None:
                continue
            host_view = target.numpy()
            for t in plan.trees:
                s = t.query_start
                host_view[..., s:s + t.num_nodes] = host_view[..., s:s + 1] + t.depths
        return
    rows = np.concatenate([t.query_start + np.arange(t.num_nodes) for t in plan.trees])
    roots = np.concatenate([np.full(t.num_nodes, t.query_start) for t in plan.trees])
    depths = np.concatenate([t.depths for t in plan.trees])
    host = torch.from_numpy(np.stack([rows, roots, depths]).astype(np.int64))
    for target in (positions, mrope_positions):
        if target is None:
            continue
        rows_d, roots_d, depths_d = host.to(target.device, non_blocking=True)
        target[..., rows_d] = target[..., roots_d] + depths_d.to(target.dtype)


def next_prefill_tokens(plan: StepPlan) -> int:
    """Prompt tokens the next step will likely run besides the decodes: what is left of the
    prompts still being prefilled, at most this step's prefill chunk (the scheduler's token
    budget keeps chunks about that size). Arrivals in the next step cannot be known."""
    left = chunk = 0  # plain Python over the batch: a few numbers (see node_tokens_of_rows)
    for computed, scheduled, prompt in zip(plan.num_computed.tolist(),
                                           plan.num_scheduled.tolist(), plan.num_prompt.tolist()):
        if computed < prompt:
            left += max(prompt - computed - scheduled, 0)
            chunk += scheduled
    return min(left, chunk)
