"""One acceptance scale for every draft-node source, calibrated online from verified steps.

A draft tree is grown best-first by P(node accepted) = P(parent accepted) x P(node | parent
accepted). The conditional factor comes from one table of *cells*, each a class of nodes with
the same evidence (``_kernels._mem_cell`` / ``_kernels._suffix_cell``):

    memory   4 rivals x 8 depths x 10 fused-probability buckets: a candidate of the fused
             G/C/U rows, by what the continuations of the same parent say (none, a weaker or
             a stronger one for another token, this token)
    suffix   11 matched-length x 7 agreement buckets: a continuation of the request's own text
    shared   the same 77 cells for continuations of the shared index (earlier outputs)

A cell's value is its prior times a factor learned online for its *row* (memory: rival x
depth; continuations: source x matched length): factor = (holds + w) / (expected + w) over
the row's tested nodes, expected = the sum of their cells' priors, so the cells of a row move
together on pooled evidence and keep the prior's shape in q or agreement (learning that shape
cell by cell from a few hundred observations only added noise in replays). A node is *tested*
when its parent was accepted (the root always is) and *holds* when it was accepted too, which
the drafter reads from what gets committed after verification. Counts are halved past
``CELL_CAP`` expected holds, so the table follows drift (a new kind of traffic) within a few
hundred observations per row; no value exceeds ``_kernels.P_MAX``.

Priors (before any evidence, fitted to SmolLM2 replays of Spec-Bench prompts): memory cells
about 0.65 q at depth 1, rising with depth; suffix cells from the matched length (~0.37 after
one token, ~0.93 from ten on) and the agreement among occurrences; shared cells lower for short
contexts. With ``learn`` off the table stays at the priors (the ablation), and memory nodes
use the paper's d(depth) * q exactly, as its builder does.

Per source and depth the drafter also counts tested nodes, held nodes and the probability the
table predicted for them (`snapshot`), so metrics can log acceptance per source and how well
the table predicts it.
"""

from __future__ import annotations

import numpy as np

from vllm_recap.core import _kernels as kernels
from vllm_recap.core.config import MAX_DEPTH

SOURCES = ("memory", "suffix", "shared")
PRIOR_WEIGHT = 20.0  # pseudo-holds of a row's prior factor 1: learning corrects it slowly
CELL_CAP = kernels.CELL_CAP

# Representative matched length of each suffix row (see _kernels._suffix_cell).
_E_REP = (1.0, 2.0, 3.0, 4.0, 5.5, 7.5, 10.5, 14.5, 20.5, 28.5, 40.0)


def _reach(length: float) -> float:
    """Prior P(the next token continues a context of `length` tokens seen once before):
    ~0.37 after one token, ~0.77 after four, ~0.93 from ten on (SmolLM2 on Spec-Bench
    extraction/summarization/rag prompts; the online counts take over from there)."""
    return 0.95 - 0.58 * float(np.exp(-(length - 1.0) / 2.5))


def _agreement(column: int, reach: float) -> float:
    """Prior of an agreement column given the single-occurrence reach: a continuation that
    only a share of the occurrences took is worth that share, roughly; one that several
    occurrences all took is more certain than a single occurrence."""
    if column < 4:
        return (0.2, 0.4, 0.65, 0.85)[column] * reach
    return 1.0 - (1.0 - reach) * (1.0, 0.55, 0.35)[column - 4]


def _shared_factor(length: float) -> float:
    """Earlier requests' outputs predict short contexts of this one poorly (~0.15 after one
    token) and long ones almost as well as its own text."""
    return 0.9 - 0.45 * float(np.exp(-(length - 1.0) / 3.0))


# Memory prior factor by rival continuation (none, weaker, stronger of another token, the same
# token): only one child of a node can hold.
_RIVAL_FACTOR = (1.0, 0.8, 0.35, 1.0)


def _memory_prior(depth: int, q: float) -> float:
    """A fused candidate of probability q holds with about 0.65 q at depth 1, more deeper
    down (a node is only tested once its parent held: the context is predictable)."""
    return q * min(0.9, 0.65 + 0.05 * (depth - 1))


def prior_table() -> np.ndarray:
    """[N_CELLS] float64 prior conditional acceptance of every cell (module docstring)."""
    prior = np.empty(kernels.N_CELLS, np.float64)
    for rival in range(kernels.MEM_RIVALS):
        for d in range(kernels.MEM_DEPTHS):
            row = (rival * kernels.MEM_DEPTHS + d) * kernels.MEM_QS
            for j in range(kernels.MEM_QS):
                prior[row + j] = _RIVAL_FACTOR[rival] * _memory_prior(
                    d + 1, (j + 0.5) / kernels.MEM_QS)
    for src in range(2):
        for e, length in enumerate(_E_REP):
            reach = _reach(length)
            factor = _shared_factor(length) if src else 1.0
            for f in range(kernels.SUF_FS):
                c = kernels.MEM_CELLS + src * kernels.SUF_CELLS + e * kernels.SUF_FS + f
                prior[c] = factor * _agreement(f, reach)
    return prior


class SourceCalibration:
    """The calibration table of one drafter, its counts and the per-source counters.

    Args:
        learn: update the table from verified steps (False: the table stays at its priors).
    """

    def __init__(self, learn: bool = True) -> None:
        self.learn = learn
        self.prior = prior_table()
        self.table = self.prior.copy()
        # [2, N_ROWS] (holds, prior-expected holds) per row, halved past CELL_CAP.
        self.stats = np.zeros((2, kernels.N_ROWS), np.float64)
        # [3, 3, MAX_DEPTH + 1]: (tested, held, predicted) x source x depth.
        self.counters = np.zeros((3, len(SOURCES), MAX_DEPTH + 1), np.float64)
        kernels.refresh_table(self.stats, self.prior, PRIOR_WEIGHT, self.table)

    def kernel_args(self) -> tuple[np.ndarray, bool]:
        """(table, learned): the builder's view of the calibration."""
        return self.table, self.learn

    def learn_step(self, tokens: np.ndarray, parents: np.ndarray, depths: np.ndarray,
                   feats: np.ndarray, n_verified: int, committed: np.ndarray) -> int:
        """Counts one verified proposal (see `_kernels.learn_step`); returns accepted drafts."""
        return int(kernels.learn_step(tokens, parents, depths, feats, n_verified, committed,
                                      self.stats, self.prior, PRIOR_WEIGHT, self.learn,
                                      self.table, self.counters))

    def cell_rate(self, cell: int) -> float:
        """The table's conditional acceptance of one cell."""
        return float(self.table[cell])

    def snapshot(self) -> dict[str, dict[str, list[float]]]:
        """Acceptance per source and depth since start, for logs and benchmarks.

        Returns:
            {source: {"tested": [...], "held": [...], "rate": [...], "predicted": [...]}}
            for "memory", "suffix", "shared"; list index i = depth i + 1, up to the deepest
            depth any source was tested at. rate = held / tested (0 where untested),
            predicted = mean probability the table gave those nodes.
        """
        tested, held, predicted = self.counters
        depths = np.nonzero(tested.sum(axis=0))[0]
        top = int(depths.max()) if depths.size else 0
        out: dict[str, dict[str, list[float]]] = {}
        for i, name in enumerate(SOURCES):
            t = tested[i, 1:top + 1]
            safe = np.maximum(t, 1.0)
            out[name] = {
                "tested": [int(v) for v in t],
                "held": [int(v) for v in held[i, 1:top + 1]],
                "rate": [round(float(v), 3) for v in np.where(t > 0, held[i, 1:top + 1] / safe,
                                                              0.0)],
                "predicted": [round(float(v), 3) for v in np.where(
                    t > 0, predicted[i, 1:top + 1] / safe, 0.0)],
            }
        return out
