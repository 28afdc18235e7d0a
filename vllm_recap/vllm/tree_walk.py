"""Walking draft trees over processed rows: greedy, lossless sampling, and logprobs.

Walking (lossless for deterministic drafts): at the current node draw x from the node's processed
distribution (argmax for greedy-equivalent requests); if x is a child's token move there and
repeat, else commit x. Draws at different nodes are independent, so every node is drawn up
front in one batched call and the walk itself is cheap index work.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.v1.outputs import LogprobsTensors

from vllm_recap.vllm.tree_sampling import (
    RequestSampling,
    TreeBatch,
    group_by_request,
    process_tree_logits,
    rows_and_owner,
)

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass(frozen=True)
class TreeWalk:
    """The outcome of walking every tree of a TreeBatch.

    Attributes:
        accepted: T arrays of accepted node indices in depth order (root excluded).
        committed: [T] int64, the token committed after the accepted path (bonus/recovered).
        target: [N] int64, the token drawn (or the argmax) at every node; a walk reads it only
            at the root and the accepted nodes.
        child_mass: [N] float32, the probability of node n's distinct child tokens under
            softmax(processed row n): the chance that a sampled walk goes deeper at n (for an
            argmax walk only a confidence: it goes deeper iff the argmax is a child). Zeros
            from ``verify_trees`` when no request of the step samples (nothing reads it there:
            the budget calibrates on accepted depths).
    """

    accepted: tuple[np.ndarray, ...]
    committed: np.ndarray
    target: np.ndarray
    child_mass: np.ndarray

    def output_tokens(self, tree: TreeBatch) -> list[list[int]]:
        """Per tree: accepted tokens then the committed one, as vLLM appends them."""
        return [tree.token[a].tolist() + [int(c)] for a, c in zip(self.accepted, self.committed)]

    def rows(self, tree: TreeBatch) -> list[np.ndarray]:
        """Per tree: the node rows that produced ``output_tokens`` (root, then accepted)."""
        return [np.concatenate(([r], a)) for r, a in zip(tree.roots, self.accepted)]


def greedy_sample(processed: torch.Tensor) -> np.ndarray:
    """[N] int64 argmax per row, vLLM's greedy choice: ``Sampler.greedy_sample`` is
    ``torch.argmax`` on CUDA and the ``greedy_argmax`` op on CPU, which breaks ties the same
    way (lowest id; NaN wins), so plain greedy trees need no vLLM import.

    On CPU, float rows take the compiled top-1 (``verifier.row_argmax``, as plain greedy
    trees already do on raw rows: the same rule, NaN with the sign bit set aside; ~5x faster
    than torch's argmax on [6, 49k] float32 rows here; imported lazily: the CUDA path runs
    where the numba core is absent)."""
    if processed.device.type == "cpu" and processed.dtype in (torch.float32, torch.bfloat16):
        from vllm_recap.vllm.verifier import row_argmax

        return row_argmax(processed)
    return processed.argmax(dim=-1).to(torch.int64).cpu().numpy()


def walk_targets(tree: TreeBatch, target: np.ndarray,
                 child_mass: np.ndarray | None = None) -> TreeWalk:
    """Walks every tree following the child whose token equals ``target`` at the current node.

    Args:
        tree: the trees.
        target: [N] int64, the token chosen at each node (argmax or a draw).
        child_mass: [N] float32 to carry into the result (zeros when None).
    Duplicate sibling tokens are redundant drafts: the lowest node index is followed.
    """
    on = np.zeros(tree.num_nodes, dtype=bool)
    on[tree.roots] = True
    last = tree.roots.copy()
    for d in range(1, tree.path_nodes.shape[1] + 1):
        nodes = np.flatnonzero(tree.depth == d)
        par = tree.parent[nodes]
        sel = nodes[on[par] & (tree.token[nodes] == target[par])]
        sel = sel[np.unique(tree.parent[sel], return_index=True)[1]]
        on[sel] = True
        last[tree.tree_of[sel]] = sel
    accepted = tuple(tree.path_nodes[v, :tree.depth[v]].copy() for v in last)
    if child_mass is None:
        child_mass = np.zeros(tree.num_nodes, dtype=np.float32)
    return TreeWalk(accepted, target[last].astype(np.int64), target, child_mass)


def children_mass(probs: torch.Tensor, tree: TreeBatch) -> np.ndarray:
    """[N] float32: sum of probs[n, t] over the distinct tokens t of node n's children."""
    kids = np.flatnonzero(tree.parent >= 0)
    pairs = np.unique(np.stack([tree.parent[kids], tree.token[kids]], axis=1), axis=0)
    mass = torch.zeros(tree.num_nodes, dtype=torch.float32, device=probs.device)
    if len(pairs):
        par = torch.as_tensor(pairs[:, 0], device=probs.device)
        tok = torch.as_tensor(pairs[:, 1], device=probs.device)
        mass.index_add_(0, par, probs[par, tok].to(torch.float32))
    return mass.cpu().numpy()


def _draw(processed: torch.Tensor, probs: torch.Tensor,
          groups: list[tuple[RequestSampling, np.ndarray]], depth: np.ndarray) -> np.ndarray:
    """[N] int64: one independent draw per node of ``groups`` (others 0): at its
    :func:`row_uniforms` draw from ``probs`` [N, V], or for a request with position seeds at
    its depth's seed from ``processed`` [N, V] (:func:`seeded_draws`)."""
    draws = np.zeros(probs.shape[0], np.int64)
    by_uniform = [(rs, nodes) for rs, nodes in groups if rs.position_seeds is None]
    if by_uniform:
        rows, owner = rows_and_owner(by_uniform)
        at = torch.as_tensor(rows, device=probs.device)
        uniforms = row_uniforms(owner, [rs for rs, _ in by_uniform], probs.device)
        draws[rows] = sample_rows(probs[at], uniforms=uniforms).cpu().numpy()
    rows, seeds = seeded_rows(groups, depth)
    if rows.size:
        draws[rows] = seeded_draws(processed[torch.from_numpy(rows)], seeds)
    return draws


def seeded_rows(groups: list[tuple[RequestSampling, np.ndarray]], depth: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """The nodes [M] of the groups whose requests have position seeds, and each one's seed
    [M] (its request's seed at the node's depth)."""
    rows, seeds = [], []
    for rs, nodes in groups:
        if rs.position_seeds is not None:
            rows.append(nodes)
            seeds.append(np.asarray(rs.position_seeds, np.int64)[depth[nodes]])
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(rows), np.concatenate(seeds)


def seeded_draws(processed: torch.Tensor, seeds: np.ndarray) -> np.ndarray:
    """[M] int64: vLLM's own draw from each processed row [M, V] at its seed [M]
    (:func:`vllm_recap.vllm.seeded.gumbel_tokens`; imported here, on the CPU path only)."""
    from vllm_recap.vllm.seeded import gumbel_tokens

    return gumbel_tokens(processed, seeds)


def row_uniforms(owner: np.ndarray, requests: Sequence[RequestSampling],
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """[S, 1] float32 on ``device`` (the requests' generators'): one uniform per row, for the
    inverse-CDF draw of :func:`sample_rows`. ``owner`` [S]: each row's index into
    ``requests``, rows of one request in node order.

    Each seeded request draws its rows with its own generator (requests in index order), so
    its walk is reproducible whatever else is in the batch; every unseeded row comes from one
    call on the default generator. Every walk of sampled rows draws through here (whole rows,
    candidates, visited rows only), so they sample the same tokens from the same rows. Rows of
    requests with position seeds are drawn at those (:func:`seeded_draws`) and get 0.5 here,
    unused: their generators are vLLM's to draw from.
    """
    u = torch.full((len(owner), 1), 0.5, device=device)
    plain = []
    # Requests with position seeds draw at those (seeded_draws): their generators are vLLM's
    # to use, and a step of only such rows makes no call below (the per-request numpy and
    # torch calls cost ~45 us of a Qwen2.5-text tree step for no draw at all).
    for g in sorted(g for g in set(owner.tolist()) if requests[g].position_seeds is None):
        rows = np.flatnonzero(owner == g)
        gen = requests[g].generator
        if gen is None:
            plain.append(rows)
        else:
            at = torch.from_numpy(rows).to(device)
            u[at] = torch.rand(len(rows), 1, generator=gen, device=device)
    if plain:
        at = torch.from_numpy(np.concatenate(plain)).to(device)
        u[at] = torch.rand(len(at), 1, device=device)
    return u


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None = None,
                uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """[M] int64: one token per row of ``probs`` [M, V] (rows sum to 1, up to rounding).

    By the inverse of each row's cumulative distribution at one uniform draw per row: the
    same distribution as ``torch.multinomial(probs, 1)``, but that costs ~1 ms a row of 49k on
    a 2-core CPU (the walk of a 17-node sampled tree: ~17 ms, half a pass) and this ~0.03 ms.
    A token of probability 0 is never drawn (its cumulative sum equals its predecessor's).
    ``uniforms`` [M, 1]: the draws, when the caller took them already (else drawn here).
    """
    cdf = probs.to(torch.float32).cumsum(dim=-1)  # [M, V]
    total = cdf[:, -1:]
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device)
    u = uniforms * total
    picked = torch.searchsorted(cdf, u, right=True).view(-1)
    over = picked >= probs.shape[1]  # u rounded up to the total: the last token of mass > 0
    if bool(over.any()):
        last = probs.shape[1] - 1 - (probs[over] > 0).flip(1).to(torch.int8).argmax(dim=1)
        picked[over] = last
    return picked


def verify_trees(processed: torch.Tensor, tree: TreeBatch,
                 requests: Sequence[RequestSampling | None]) -> TreeWalk:
    """Walks greedy-equivalent requests' trees by argmax and the others by sampling.

    Args:
        processed: [N, V] float32 from ``process_tree_logits``.
        tree: the trees.
        requests: as for ``process_tree_logits``.
    """
    target = greedy_sample(processed)
    drawn = [(rs, nodes) for rs, nodes in group_by_request(tree, requests) if not rs.greedy_equivalent]
    if not drawn:  # argmax walks: no [N, V] softmax, the children's mass stays zero
        return walk_targets(tree, target)
    probs = processed.softmax(dim=-1, dtype=torch.float32)
    rows, _ = rows_and_owner(drawn)
    target[rows] = _draw(processed, probs, drawn, tree.depth)[rows]
    return walk_targets(tree, target, children_mass(probs, tree))


def walk_visited(rows: Callable[[np.ndarray], torch.Tensor], tree: TreeBatch,
                 requests: Sequence[RequestSampling | None]
                 ) -> tuple[TreeWalk, np.ndarray, torch.Tensor]:
    """:func:`verify_trees`' walk, processing only the rows it visits.

    A walk reads a node's target only at the roots and the accepted nodes, and draws at
    different nodes are independent, so the rows are processed one tree level at a time: the
    roots, then the children the roots' targets picked, and so on. A sampled tree accepts one
    or two nodes, so instead of every row of the tree this processes about two per request
    (T 1.0, 17-node tree of SmolLM2's 49k vocabulary on a 2-core CPU: processing and walking
    every row ~6 ms, a row ~0.4 ms). Every sampled row's uniform is drawn up front as
    :func:`_draw` draws it (:func:`row_uniforms`: same generators, same order), so the walk
    commits the tokens :func:`verify_trees` commits and leaves the generators in the same state;
    rows of requests with position seeds take their depth's seed (:func:`seeded_draws`).

    Args:
        rows: node indices [M] -> their raw logits rows [M, V].
        tree, requests: as for :func:`verify_trees`.

    Returns:
        The walk (``target`` and ``child_mass`` are 0 at nodes not visited), the visited nodes
        [M] (level by level, ascending within a level), and their processed rows [M, V].
    """
    n = tree.num_nodes
    drawn = [(rs, nodes) for rs, nodes in group_by_request(tree, requests)
             if not rs.greedy_equivalent]
    sampled = np.zeros(n, bool)
    uniforms = torch.zeros(n, 1)
    seed_of = np.full(n, -1, np.int64)  # a node's position seed, -1: drawn at its uniform
    by_uniform = [(rs, nodes) for rs, nodes in drawn if rs.position_seeds is None]
    if drawn:
        at, _ = rows_and_owner(drawn)
        sampled[at] = True
    if by_uniform:
        at, owner = rows_and_owner(by_uniform)
        uniforms[torch.from_numpy(at)] = row_uniforms(owner, [rs for rs, _ in by_uniform])
    at, seeds = seeded_rows(drawn, tree.depth)
    seed_of[at] = seeds
    child: dict[tuple[int, int], int] = {}  # (parent, token) -> lowest child (walk_targets)
    for v, (p, t) in enumerate(zip(tree.parent.tolist(), tree.token.tolist())):
        if p >= 0:
            child.setdefault((p, t), v)
    target = np.zeros(n, np.int64)
    last = tree.roots.copy()  # per tree, the deepest node its walk reached
    tree_of = tree.tree_of.tolist()
    visited, processed = [], []
    level = tree.roots
    while level.size:
        rows_p = process_tree_logits(rows(level), tree, requests, nodes=level)
        drawn_here = np.flatnonzero(sampled[level])
        if drawn_here.size < level.size:
            picked = greedy_sample(rows_p)
        else:
            picked = np.zeros(level.size, np.int64)
        by_seed = drawn_here[seed_of[level[drawn_here]] >= 0]
        if by_seed.size:
            picked[by_seed] = seeded_draws(rows_p[torch.from_numpy(by_seed)],
                                           seed_of[level[by_seed]])
            drawn_here = drawn_here[seed_of[level[drawn_here]] < 0]
        if drawn_here.size:
            every = drawn_here.size == level.size  # no copy of the rows then
            probs = (rows_p if every else rows_p[torch.from_numpy(drawn_here).to(rows_p.device)]
                     ).softmax(dim=-1, dtype=torch.float32)
            u = uniforms[torch.from_numpy(level[drawn_here])].to(rows_p.device)
            picked[drawn_here] = sample_rows(probs, uniforms=u).cpu().numpy()
        target[level] = picked
        visited.append(level)
        processed.append(rows_p)
        nxt = [child.get((v, t), -1) for v, t in zip(level.tolist(), picked.tolist())]
        level = np.array(sorted(v for v in nxt if v >= 0), np.int64)
        last[[tree_of[v] for v in level.tolist()]] = level
    accepted = tuple(tree.path_nodes[v, :tree.depth[v]].copy() for v in last)
    walk = TreeWalk(accepted, target[last], target, np.zeros(n, np.float32))
    return (walk, np.concatenate(visited),
            processed[0] if len(processed) == 1 else torch.cat(processed))


def greedy_walk(processed: torch.Tensor, tree: TreeBatch) -> TreeWalk:
    """Walks every tree by the argmax of its processed rows.

    The argmax follows vLLM's ``Sampler.greedy_sample`` (:func:`greedy_sample`): the lowest
    token id wins a tie.
    """
    probs = processed.softmax(dim=-1, dtype=torch.float32)
    target = greedy_sample(processed)
    return walk_targets(tree, target, children_mass(probs, tree))


def sample_walk(processed: torch.Tensor, tree: TreeBatch,
                requests: Sequence[RequestSampling | None]) -> TreeWalk:
    """Lossless tree sampling for every tree: draw x from the node's processed distribution;
    move to the child whose token is x, else commit x.

    The accepted path + x is distributed as sequential sampling, and the walk goes deeper at n
    with probability ``child_mass[n]``. Raises ValueError for a greedy (temperature 0) request:
    its row is an argmax input, not a distribution.

    Args:
        processed: [N, V] float32 from ``process_tree_logits``.
    """
    groups = group_by_request(tree, requests)
    if any(rs.is_greedy for rs, _ in groups):
        raise ValueError("sample_walk got a greedy request; use greedy_walk or verify_trees")
    probs = processed.softmax(dim=-1, dtype=torch.float32)
    return walk_targets(tree, _draw(processed, probs, groups, tree.depth),
                        children_mass(probs, tree))


def tree_logprobs(walk: TreeWalk, tree: TreeBatch, raw_logits: torch.Tensor,
                  processed: torch.Tensor, num_logprobs: int,
                  mode: str = "raw_logprobs") -> "LogprobsTensors":
    """The logprobs rows sequential vLLM returns for each tree's accepted path + final token.

    Args:
        walk: the walk; rows are, per tree, its root then its accepted nodes.
        raw_logits: [N, V] model logits (model dtype) of the nodes.
        processed: [N, V] float32 from ``process_tree_logits``.
        num_logprobs: the batch's ``max_num_logprobs`` (the vocab size for ``logprobs=-1``).
        mode: vLLM's ``logprobs_mode``.
    Returns:
        vLLM's LogprobsTensors over all trees in order: ids/logprobs [M, num_logprobs + 1]
        (the chosen token first, then the top ones), ranks [M]; ``cu_num_generated_tokens`` [T+1].
    """
    from vllm.v1.sample.sampler import Sampler

    if mode not in LOGPROBS_MODES:
        raise ValueError(f"mode must be one of {LOGPROBS_MODES}, got {mode!r}")
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs}")
    per_tree = walk.rows(tree)
    rows = torch.as_tensor(np.concatenate(per_tree), device=raw_logits.device)
    tokens = torch.as_tensor(np.concatenate([t for t in walk.output_tokens(tree)]),
                             dtype=torch.int64, device=raw_logits.device)
    src = raw_logits if mode.startswith("raw") else processed
    picked = src[rows]
    logprobs = (picked.to(torch.float32) if mode.endswith("logits")
                else Sampler.compute_logprobs(picked))
    out = Sampler.gather_logprobs(logprobs, num_logprobs, tokens)
    cu = np.concatenate(([0], np.cumsum([len(r) for r in per_tree]))).tolist()
    return out._replace(cu_num_generated_tokens=cu)
