"""Tree acceptance of one step, written in vLLM's chain layout (tokens and logprobs).

vLLM's rejection sampler only knows chains. For requests that verified a tree, the step's
rows are processed per node with vLLM's sampling semantics on each node's path
(:mod:`~vllm_recap.vllm.tree_sampling`), walked by argmax or by lossless sampling
(:mod:`~vllm_recap.vllm.tree_walk`), and the result overwrites the request's row of vLLM's
output ``[batch, max_spec + 1]`` (accepted path tokens, then the committed token, -1 padding)
and, when logprobs were asked for, its logprobs rows -- so the scheduler, bookkeeping and
spec-decode metrics work unchanged. Chains keep vLLM's result, except in a step RECAP
verifies whole (``StepPlan.verified``: every request a greedy-equivalent decode), where they
are walked here as single-path trees and vLLM's sampler does not run.

Two phases, because vLLM's sampler may edit the logits in place: :func:`prepare` runs before
it (reads the tree rows, walks), :func:`write` after it (overwrites its output).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput

from vllm_recap.vllm.candidate_walk import (CANDIDATES, CandidateRows, from_candidates,
                                            walk_rows)
from vllm_recap.vllm.context import StepPlan
from vllm_recap.vllm.tree_sampling import (RequestSampling, TreeBatch, candidate_memory_rows,
                                           penalised_top_argmax, penalties_only,
                                           process_tree_logits)
from vllm_recap.vllm.token_history import TokenHistory
from vllm_recap.vllm.tree_walk import TreeWalk, tree_logprobs, verify_trees, walk_visited
from vllm_recap.vllm.verifier import row_argmax, rows_topk, rows_values, topk_rows

PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID for rejected positions
SeedsOf = Callable[[str, int], "tuple[int, ...] | None"]


@dataclass
class TreeVerification:
    """The walked trees of one step, ready to be written into vLLM's output.

    Attributes:
        nodes: per tree, its accepted node indices within the tree (depth order, root
            excluded).
        tokens: per tree, the accepted tokens then the committed one, as vLLM appends them.
        batch: all tree nodes of the step (``batch.req`` = batch row); None for plain greedy
            trees walked one by one (:func:`_walk_plain`).
        walk: accepted nodes (global) and committed token per tree (None when ``batch`` is).
        raw: [N, V] the nodes' logits rows (copies), kept only if logprobs may be written.
        processed: [N, V] float32 processed rows (same condition).
        memory_rows: (logits rows [N], ids [N, K], probs [N, K]): top-K rows of the nodes'
            processed distributions, for the memories, when some request processes its rows
            (penalties, temperature, masks); None when every tree is plain greedy.
    """

    nodes: list[np.ndarray]
    tokens: list[list[int]]
    batch: TreeBatch | None = None
    walk: TreeWalk | None = None
    raw: torch.Tensor | None = None
    processed: torch.Tensor | None = None
    memory_rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def of_walk(cls, batch: TreeBatch, offsets: list[int], walk: TreeWalk,
                **rows) -> TreeVerification:
        """From a walk over the step's whole TreeBatch (``offsets``: each tree's root)."""
        return cls([a - off for off, a in zip(offsets, walk.accepted)],
                   walk.output_tokens(batch), batch, walk, **rows)

    def accepted(self, plan: StepPlan) -> dict[int, np.ndarray]:
        """Batch row -> accepted node indices within its tree (depth order, root excluded)."""
        return {t.batch_index: nodes for t, nodes in zip(plan.verified, self.nodes)}


def request_sampling(runner, req_id: str, history: TokenHistory | None = None,
                     position_seeds: tuple[int, ...] | None = None) -> RequestSampling:
    """The request's sampling state as vLLM's input batch holds it this step (``history``:
    the request's, kept between steps, synced here; ``position_seeds``: its rows' seeds by
    depth, for a seeded request whose draws are replayed)."""
    state = runner.requests[req_id]
    return RequestSampling.from_params(state.sampling_params, state.prompt_token_ids,
                                       state.output_token_ids, state.generator, history,
                                       position_seeds)


def prepare(plan: StepPlan, logits: torch.Tensor, node_tokens: np.ndarray, runner,
            keep_rows: bool, argmax: np.ndarray | None = None,
            top_k: int = 0, top_ids: np.ndarray | None = None,
            plain: bool = False,
            history_of: Callable[[str], TokenHistory | None] | None = None,
            seeds_of: SeedsOf | None = None) -> TreeVerification:
    """Processes and walks every tree of the step (before vLLM's sampler runs).

    Args:
        plan: the step layout (``plan.verified`` non-empty).
        logits: [R, V] the step's logits (1 + drafts rows per request).
        node_tokens: [R] the token at each logits row.
        runner: vLLM's model runner (``requests``: sampling params, tokens, generator).
        keep_rows: keep raw and processed rows for logprobs.
        argmax: [R] each logits row's argmax by vLLM's rule (lowest id among equal maxima),
            when the caller has it (the top-1 of the memory rows on CPU); else computed here.
        top_k: K of the memory rows taken from processed distributions (0: none).
        top_ids: [R, K] each logits row's raw top-K ids, largest first, when the caller has
            them (the memory rows): penalised greedy trees are then decided from them.
        plain: every tree request is greedy-equivalent with nothing else to process
            (:attr:`~vllm_recap.vllm.eligibility.SamplingFacts.plain`, kept per request by
            the caller): without ``keep_rows`` their sampling state is then not read at all.
        history_of: request id -> its :class:`TokenHistory` (None: none kept), so that
            penalties need not sort the prompt and output each step.
        seeds_of: (request id, rows) -> the seeds of its rows at depth 0 .. rows - 1, or None
            where the request draws at uniforms (:mod:`~vllm_recap.vllm.seeded`).
    """
    starts = plan.logits_starts.tolist()
    flat = [j for t in plan.verified
            for j in range(starts[t.batch_index], starts[t.batch_index] + t.num_nodes)]
    requests = None
    if not keep_rows and not plain:  # the caller did not say: read every request's state
        requests = _request_states(plan, runner, keep_rows, history_of, seeds_of)
        plain = all(r.is_plain for r in requests if r is not None)
    if plain and not keep_rows:
        # Plain greedy trees (the common case): the raw rows' argmax decides; no copy of the
        # [N, V] rows and no softmax.
        targets = (argmax[flat] if argmax is not None
                   else row_argmax(logits[torch.tensor(flat, device=logits.device)]))
        return _walk_plain(plan, node_tokens[flat], targets)
    if requests is None:
        requests = _request_states(plan, runner, keep_rows, history_of, seeds_of)
    flat = np.asarray(flat, np.int64)
    live = [r for r in requests if r is not None]
    if not keep_rows and top_ids is not None and top_k > 0 \
            and all(penalties_only(r) for r in live):
        # Qwen2.5-VL's recommended settings (repetition penalty, top_k 1): the argmax from the
        # raw top-K when it is decided there (almost always), whole rows otherwise.
        ver = _walk_penalised(plan, logits, flat, node_tokens[flat], top_ids[flat], requests)
        if ver is not None:
            return ver
    elif not keep_rows and top_k > 0 and all(from_candidates(r) for r in live) \
            and any(not r.is_greedy for r in live):
        # Sampled with top-k (Qwen2.5's text settings): decided by each row's largest logits.
        ver = _walk_candidates(plan, logits, flat, node_tokens[flat], requests, top_k)
        if ver is not None:
            return ver
    batch, offsets = _tree_batch(plan, node_tokens[flat])
    if not keep_rows and logits.device.type == "cpu":
        return _walk_visited(logits, flat, batch, offsets, requests, top_k, top_ids)
    return _walk_every_row(logits, flat, batch, offsets, requests, top_k, keep_rows)


def _walk_every_row(logits: torch.Tensor, flat: np.ndarray, batch: TreeBatch,
                    offsets: list[int], requests: list[RequestSampling | None], top_k: int,
                    keep_rows: bool) -> TreeVerification:
    """Walks of the step's trees over every node row processed whole (logprobs need the
    rows; on a device one batched pass beats a call per tree level). Arguments as
    :func:`_walk_visited`."""
    raw = logits[torch.from_numpy(flat).to(logits.device)]
    processed = process_tree_logits(raw, batch, requests)
    walk = verify_trees(processed, batch, requests)
    # The memories learn what the target picks under the request's own processing: with
    # Qwen2.5-VL's repetition penalty 1.05 a seen token's logit of ~20 drops by ~1, which
    # often moves the argmax away from the raw row's top-1 that a raw row would draft.
    memory = (flat, *topk_rows(processed, top_k)) if top_k > 0 else None
    return TreeVerification.of_walk(batch, offsets, walk, raw=raw if keep_rows else None,
                                    processed=processed if keep_rows else None,
                                    memory_rows=memory)


def _request_states(plan: StepPlan, runner, keep_rows: bool,
                    history_of: Callable[[str], TokenHistory | None] | None = None,
                    seeds_of: SeedsOf | None = None) -> list[RequestSampling | None]:
    """Per batch row, the sampling state of its tree's request (None for rows without one).

    Without ``keep_rows``, greedy-equivalent requests (top_k = 1) are walked by argmax:
    temperature and top-k/p do not move the argmax, so they are dropped (they sort the
    vocabulary) unless logprobs of the processed rows are needed."""
    requests: list[RequestSampling | None] = [None] * len(plan.req_ids)
    for tree in plan.verified:
        req_id = plan.req_ids[tree.batch_index]
        rs = request_sampling(runner, req_id, history_of(req_id) if history_of else None,
                              seeds_of(req_id, tree.num_nodes) if seeds_of else None)
        if not keep_rows and not rs.is_greedy and rs.greedy_equivalent:
            rs = replace(rs, temperature=0.0)
        requests[tree.batch_index] = rs
    return requests


def _tree_batch(plan: StepPlan, tokens: np.ndarray) -> tuple[TreeBatch, list[int]]:
    """The step's trees as one TreeBatch (``tokens`` [N]: their nodes' tokens, trees in
    ``plan.verified`` order) and each tree's root index in it."""
    req, parent, offsets, total = [], [], [], 0
    for tree in plan.verified:
        req.append(np.full(tree.num_nodes, tree.batch_index))
        parent.append(np.where(tree.parents >= 0, tree.parents + total, -1))
        offsets.append(total)
        total += tree.num_nodes
    return (TreeBatch.from_parents(np.concatenate(req), np.concatenate(parent), tokens),
            offsets)


def _walk_penalised(plan: StepPlan, logits: torch.Tensor, flat: np.ndarray, tokens: np.ndarray,
                    ids: np.ndarray, requests: list[RequestSampling | None]
                    ) -> TreeVerification | None:
    """Greedy walks of penalised trees decided from each node row's raw top K
    (:func:`~vllm_recap.vllm.tree_sampling.penalised_top_argmax`); None when some row is not
    decided there.

    Args:
        plan: the step layout.
        logits: [R, V] the step's logits.
        flat: [N] the tree nodes' logits rows, trees in ``plan.verified`` order.
        tokens: [N] their tokens.
        ids: [N, K] their rows' raw top-K ids.
        requests: per batch row, its sampling state (each tree's :func:`penalties_only`).
    """
    values = rows_values(logits, flat, ids)
    owner, paths = _node_paths(plan, tokens)
    argmax, mem_ids, mem_probs = penalised_top_argmax(values, ids, owner, paths, requests)
    if argmax is None:
        return None
    ver = _walk_plain(plan, tokens, argmax)
    ver.memory_rows = (flat, mem_ids, mem_probs)
    return ver


def _walk_candidates(plan: StepPlan, logits: torch.Tensor, flat: np.ndarray,
                     tokens: np.ndarray, requests: list[RequestSampling | None],
                     memory_k: int) -> TreeVerification | None:
    """Walks of the step's trees decided from each node row's ``CANDIDATES`` largest logits
    (:mod:`~vllm_recap.vllm.candidate_walk`); a row they do not decide is processed whole
    when a walk reaches it (a walk stops at a pending row's target -1, which no child has;
    that row is resolved and the trees walked again), rows no walk reaches keep their
    candidates' memory rows. None on a device. Arguments as :func:`_walk_penalised` (each
    request :func:`~vllm_recap.vllm.candidate_walk.from_candidates`)."""
    top = rows_topk(logits, flat, min(CANDIDATES, logits.shape[1]))
    if top is None:
        return None
    ids, values = top
    owner, paths = _node_paths(plan, tokens)
    rows = walk_rows(values, ids, owner, paths, requests, memory_k,
                     lambda r: logits[int(flat[r])])
    ver = _walk_resolving(plan, tokens, rows)
    ver.memory_rows = (flat, rows.memory_ids, rows.memory_probs)
    return ver


def _walk_resolving(plan: StepPlan, tokens: np.ndarray, rows: CandidateRows
                    ) -> TreeVerification:
    """:func:`_walk_plain` over ``rows.target``, resolving the pending rows the walks reach:
    a walk stops at a pending row (its target -1 is no child's token); that row is processed
    whole and the trees walked again, until no walk ends at a pending row. The result is the
    walk over every row resolved; rows no walk reaches stay pending."""
    starts = np.cumsum([0] + [t.num_nodes for t in plan.verified]).tolist()
    while True:
        ver = _walk_plain(plan, tokens, rows.target)
        # the row each walk stopped at: its last accepted node's, or its root's
        ends = [start + (int(nodes[-1]) if len(nodes) else 0)
                for start, nodes in zip(starts, ver.nodes)]
        reached = [r for r in ends if r in rows.pending]
        if not reached:
            return ver
        for r in reached:
            rows.resolve(r)


def _walk_visited(logits: torch.Tensor, flat: np.ndarray, batch: TreeBatch, offsets: list[int],
                  requests: list[RequestSampling | None], top_k: int,
                  top_ids: np.ndarray | None) -> TreeVerification:
    """Walks of trees the candidates do not decide (T 1.0, top-p without top-k, min-p,
    masks...) processing whole rows, but only those the walks visit
    (:func:`~vllm_recap.vllm.tree_walk.walk_visited`); on CPU, where each row costs a few
    passes over the vocabulary and one more call per tree level costs little.

    The memories get the visited rows' processed top K, and for the other nodes their raw
    top-K candidates penalised and divided by the temperature
    (:func:`~vllm_recap.vllm.tree_sampling.candidate_memory_rows`): what the target would
    pick there as far as the candidates show it, without processing the row (masks and
    top-p/min-p cuts aside). Arguments as :func:`_walk_penalised`; ``offsets``: each tree's
    root in ``batch``; ``top_ids`` [R, K]: every logits row's raw top-K ids, or None.
    """
    at = torch.from_numpy(flat)
    walk, visited, processed = walk_visited(lambda nodes: logits[at[nodes]], batch, requests)
    memory = None
    if top_k > 0:
        ids, probs = topk_rows(processed, top_k)
        rest = np.setdiff1d(np.arange(len(flat)), visited)
        if top_ids is not None and rest.size:
            cand = top_ids[flat[rest]]
            values = rows_values(logits, flat[rest], cand)
            path = batch.path_tokens()[rest]
            paths = [p[:d].tolist() for p, d in zip(path, batch.depth[rest])]
            r_ids, r_probs = candidate_memory_rows(values, cand, batch.req[rest], paths,
                                                   requests)
            visited = np.concatenate([visited, rest])
            ids, probs = np.concatenate([ids, r_ids]), np.concatenate([probs, r_probs])
        memory = (flat[visited], ids, probs)
    return TreeVerification.of_walk(batch, offsets, walk, memory_rows=memory)


def _node_paths(plan: StepPlan, tokens: np.ndarray) -> tuple[np.ndarray, list[list[int]]]:
    """Per tree node (trees in ``plan.verified`` order): its request's batch row [N] and the
    tokens on its path (root excluded, the node included)."""
    owner, paths, start, tok = [], [], 0, tokens.tolist()
    for tree in plan.verified:
        node_paths: list[list[int]] = [[]]
        for i, p in enumerate(tree.parents.tolist()[1:], 1):
            node_paths.append(node_paths[p] + [tok[start + i]])
        paths.extend(node_paths)
        owner.extend([tree.batch_index] * tree.num_nodes)
        start += tree.num_nodes
    return np.asarray(owner, np.int64), paths


def _walk_plain(plan: StepPlan, tokens: np.ndarray, targets: np.ndarray) -> TreeVerification:
    """Greedy walks of the step's trees by the argmax of each node's row, tree by tree.

    The same rule as :func:`~vllm_recap.vllm.tree_walk.walk_targets` (follow the child whose
    token is the current node's target, the lowest index among duplicates), in plain Python
    over each tree's few nodes: the vectorised walk over a whole TreeBatch costs ~0.2 ms of
    numpy calls a step, most of a batch-1 step's acceptance work.

    Args:
        plan: the step layout.
        tokens: [N] the tree nodes' tokens, trees in ``plan.verified`` order.
        targets: [N] each node's argmax, same order.
    """
    tok, tgt = tokens.tolist(), targets.tolist()
    nodes, out, start = [], [], 0
    for tree in plan.verified:
        n = tree.num_nodes
        children: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(tree.parents.tolist()[1:], 1):
            children[p].append(i)
        walked, v = [], 0
        while True:
            want = tgt[start + v]
            v = next((c for c in children[v] if tok[start + c] == want), -1)
            if v < 0:
                break
            walked.append(v)
        nodes.append(np.array(walked, np.int64))
        out.append([tok[start + i] for i in walked] + [int(want)])
        start += n
    return TreeVerification(nodes, out)


def write(ver: TreeVerification, plan: StepPlan, output, logprobs_mode: str) -> None:
    """Overwrites the tree requests' rows of vLLM's sampler output.

    Args:
        ver: from :func:`prepare`.
        plan: the step layout.
        output: vLLM's ``SamplerOutput``: ``sampled_token_ids`` [B, W] (W = max_spec + 1),
            ``logprobs_tensors`` None or rows [B * W, k + 1] in the same (batch, position)
            order, modified in place.
        logprobs_mode: vLLM's ``logprobs_mode`` (raw or processed, logprobs or logits).
    """
    sampled = output.sampled_token_ids
    width = sampled.shape[1]
    tokens = ver.tokens
    rows = _padded(tokens, width)
    if sampled.device.type == "cpu":  # numpy rows: after the forward each torch op costs ~20 us
        view = sampled.numpy()
        for tree, row in zip(plan.verified, rows):
            view[tree.batch_index] = row
    else:
        index = torch.tensor([t.batch_index for t in plan.verified], device=sampled.device)
        sampled[index] = torch.tensor(rows, dtype=sampled.dtype).to(sampled.device)
    lp = output.logprobs_tensors
    if lp is None or ver.raw is None:
        return
    ours = tree_logprobs(ver.walk, ver.batch, ver.raw, ver.processed,
                         lp.logprobs.shape[1] - 1, logprobs_mode)
    dest = torch.from_numpy(np.concatenate(
        [tree.batch_index * width + np.arange(len(path))
         for tree, path in zip(plan.verified, tokens)])).to(lp.logprobs.device)
    lp.logprob_token_ids[dest] = ours.logprob_token_ids.to(lp.logprob_token_ids.dtype)
    lp.logprobs[dest] = ours.logprobs.to(lp.logprobs.dtype)
    lp.selected_token_ranks[dest] = ours.selected_token_ranks.to(lp.selected_token_ranks.dtype)


def tree_output(ver: TreeVerification, plan: StepPlan, device: torch.device):
    """vLLM's ``SamplerOutput`` for a step whose every request verified a tree (no logprobs):
    ``sampled_token_ids`` [B, max_spec + 1], each row the request's accepted path then its
    committed token, -1 padded (what :func:`write` puts into vLLM's own output)."""
    width = int(plan.num_drafts.max()) + 1
    rows = [[]] * len(plan.req_ids)
    for tree, row in zip(plan.verified, _padded(ver.tokens, width)):
        rows[tree.batch_index] = row
    # numpy, then a view: right after the forward every call runs on cold caches, and
    # torch.tensor over nested lists cost 86 us there (19 us warm), this 53 us
    # (benchmarks.proposer_profile --again, SmolLM2 bf16, fixed 8 nodes)
    sampled = torch.from_numpy(np.array(rows, np.int32))
    return SamplerOutput(sampled_token_ids=sampled if device.type == "cpu" else sampled.to(device),
                         logprobs_tensors=None)


def _padded(paths: list[list[int]], width: int) -> list[list[int]]:
    """Each path (accepted tokens then the committed one) padded with -1 to ``width``."""
    return [path + [PLACEHOLDER] * (width - len(path)) for path in paths]
