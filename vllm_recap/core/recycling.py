"""Token Recycling's static tree template (Luo et al. 2024), as used in this project.

Token Recycling keeps a persistent [vocab, 8] adjacency of top-8 successors (RECAP's U with
K = 8) and fills a *static* 80-node template breadth-first: template node = (parent template
node, rank r) means "the r-th successor of the parent's token". The same template, filled with
RECAP's fused q instead, is the FIXED-tree ablation.

The paper gives the level sizes (8/21/25/15/8/3) but the exact node placement used here is our
own, derived deterministically so it can be regenerated and tested: assume a static acceptance
prior per rank, `RANK_PRIOR`, score a node by the product of its path's rank priors, and fill
each level with its best-scoring (parent, rank) pairs (ties: parent order, then rank). This
puts most nodes under low ranks, like the authors' hand-made trees.

Layout: root at 0, then the rank-0 chain (depths 1..6), then the remaining nodes level by
level -- parents-first and best chain first, so truncating the template to a node budget keeps
the deepest likely path.
"""

from __future__ import annotations

import numpy as np

LEVEL_SIZES: tuple[int, ...] = (8, 21, 25, 15, 8, 3)
"""Template nodes per depth 1..6 (80 in all)."""

RANK_PRIOR: tuple[float, ...] = (0.60, 0.15, 0.08, 0.05, 0.04, 0.03, 0.03, 0.02)
"""Assumed acceptance probability of the r-th successor, used only to place template nodes."""


def make_template(
    level_sizes: tuple[int, ...] = LEVEL_SIZES, rank_prior: tuple[float, ...] = RANK_PRIOR
) -> tuple[np.ndarray, np.ndarray]:
    """Builds the static template.

    Returns:
        parents: [1 + sum(level_sizes)] int64, parents[0] == -1, parents-first.
        ranks: same shape int64, the successor rank of each node (root: -1).
    """
    # Level-by-level selection over (score, parent, rank), parents identified by their
    # position in the previous level.
    levels: list[list[tuple[float, int, int]]] = [[(1.0, -1, -1)]]
    for size in level_sizes:
        prev = levels[-1]
        cands = [(prev[p][0] * prior, p, r)
                 for p in range(len(prev)) for r, prior in enumerate(rank_prior)]
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen = sorted(cands[:size], key=lambda c: (c[1], c[2]))
        levels.append(chosen)
    # Global ids: (level, index in level). Rank-0 chain first, then the rest level by level.
    chain: list[tuple[int, int]] = [(0, 0)]
    for lvl in range(1, len(levels)):
        parent_idx = chain[-1][1]
        found = [i for i, (_, p, r) in enumerate(levels[lvl]) if p == parent_idx and r == 0]
        if not found:
            break
        chain.append((lvl, found[0]))
    order = list(chain)
    in_chain = set(chain)
    for lvl in range(1, len(levels)):
        order.extend((lvl, i) for i in range(len(levels[lvl])) if (lvl, i) not in in_chain)
    new_id = {node: i for i, node in enumerate(order)}
    parents = np.full(len(order), -1, np.int64)
    ranks = np.full(len(order), -1, np.int64)
    for i, (lvl, idx) in enumerate(order):
        if lvl == 0:
            continue
        _, p, r = levels[lvl][idx]
        parents[i] = new_id[(lvl - 1, p)]
        ranks[i] = r
    return parents, ranks


TEMPLATE_PARENTS, TEMPLATE_RANKS = make_template()
"""The 80-node template (+ root): [81] parents and [81] ranks."""
