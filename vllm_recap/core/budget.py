"""How many draft nodes to verify per step: a measured cost model against calibrated gains.

Verifying more tree nodes costs target time; on a large GPU model almost nothing up to ~64
tokens, on a 2-core CPU a lot (the matrix kernels fall off a cliff between 1 and 2 rows). A
fixed budget is therefore right on one machine and wrong on the next, and wrong again as the
batch grows. The controller picks, every step, the number ``D`` of draft nodes of the whole
step, their split ``b_r`` over the requests and their shape (trees, or each tree's best chain)
that maximise expected committed tokens per second of engine time:

    throughput(D) = sum_r (1 + E_r(b_r)) / T(fixed + sum_r 1, drafts = D, shape)

- ``T(n, drafts, shape)``: seconds of one engine step that runs ``n`` other tokens plus
  ``drafts`` draft tokens, learned online from the steps actually run
  (:class:`~vllm_recap.core.step_cost.StepCostModel`): the plain cost of the other tokens
  plus the measured extra cost of draft tokens (which cost more than prefill tokens of the
  same count), kept apart for tree steps and chain steps. An unmeasured size between two
  measured ones is interpolated linearly; larger ones are extrapolated (optimistically while
  drafts were never measured), so larger budgets get tried, measured, and dropped if they do
  not pay. A size is re-measured now and then, since machines and loads drift.
- ``E_r(b)``: expected accepted tokens if request r verifies the first ``b`` nodes of its tree
  (layout order, parents first) or of its best chain. Each node contributes P(node accepted),
  estimated from its builder score times a calibration factor per depth and score range
  learned from verified steps (:class:`AcceptanceCalibration`). Summing P(node accepted) over
  nodes gives the expected accepted length exactly, because at most one node per depth is
  accepted. The split ``b_r`` of each ``D`` takes the likeliest nodes of the batch
  (:func:`_merge`).

``D = 0`` (no speculation) is always a candidate, which is what keeps the policy from being
slower than plain decoding once its estimates are measured.

While the batch drains (no request takes a finished one's place) committed tokens are the
wrong currency: the batch runs until its last request is done, and on a CPU a step of one
request costs nearly what a step of nine does, so tokens of requests that finish earlier
shorten nothing. Then the controller prices the step by how far it shortens the remaining
run (:class:`Drain`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from vllm_recap.core import _kernels as kernels
from vllm_recap.core.config import MAX_DEPTH, discount_table
from vllm_recap.core.step_cost import StepCostModel
from vllm_recap.core.tree import DraftTree, first_path_nodes, tree_depths

# Candidate totals of a step's draft nodes (each request gets at most the configured budget).
LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# Expected throughput a drafting choice must exceed plain decoding's by (see ``choose``): at
# batch 1, and more per further decoding request, up to a cap (see ``draft_margin``).
DRAFT_MARGIN = 1.03
MARGIN_PER_REQUEST = 0.01
MAX_DRAFT_MARGIN = 1.18

# Outcome correction per level (see LevelOutcomes): pseudo-steps of its prior (its shape's
# pooled ratio, itself shrunk to 1 with as many), the per-step decay of past outcomes, and
# the range a single step's ratio is clipped to.
OUTCOME_PRIOR_STEPS = 3.0
OUTCOME_DECAY = 0.95
OUTCOME_CLIP = (0.33, 3.0)


def draft_margin(decoding: int) -> float:
    """The margin for a step of ``decoding`` requests: 1.03 at batch 1, 1.06 at 4, 1.18 from
    16 on.

    Under load the margin has to grow. A drafted step's expected gain shrinks with the batch
    (at concurrency 16 on a 2-core CPU the best level returned ~5% more tokens per second
    than plain decoding, while single estimates are off by ~20%), so the level whose
    estimate looks best is mostly the most overrated one. And the tokens are worth less than
    they count: once no request waits, a batch runs until its slowest request is done, and
    drafts accepted by the others do not shorten it. Measured (interleaved, 26 prompts x 64
    tokens, bf16): RECAP tree drafting at the batch-1 margin ran at 0.91x of plain decoding at
    concurrency 16, while the same engine not drafting ran at 1.04x."""
    return min(MAX_DRAFT_MARGIN, DRAFT_MARGIN + MARGIN_PER_REQUEST * max(0, decoding - 1))


@dataclass(frozen=True)
class Drain:
    """The batch drains: price a step by the steps it takes off the batch's remaining run.

    The remaining run is as long as its longest request, the one with the most tokens still
    to commit (its *remaining* tokens, from ``max_tokens`` and the model's length); drafts
    shorten it only through that request, or through all of them when several tie. So the
    trees passed to :meth:`BudgetController.choose` are the longest requests' only (the
    other decoding requests run a token each, counted in ``fixed_tokens``), and a drafting
    level is worth ``1 + min(slack, min_r G_r(D))`` steps of the run per step, ``G_r(D)``
    being request r's expected accepted drafts among the level's D nodes, against one step
    for plain decoding. Measured (Intel Xeon with AMX, bf16, SmolLM2, 26 prompts x 64 tokens
    at concurrency 16): drafting the last nine requests by committed tokens ran each of
    those steps 1.34x faster in tokens, yet took only 1-2 steps off a 63-step drain while
    every drafted step cost a third more, and the whole run fell to 0.87-0.94x of plain
    decoding.

    Attributes:
        slack: how many tokens the longest requests lead the next-longest request in flight
            by (drafting them shortens the run by at most that much before another request
            is the longest); ``inf`` when every request in flight is among them.
        decoding: decoding requests in the step (the margin's batch size).
    """

    slack: float
    decoding: int


class AcceptanceCalibration:
    """Maps builder scores to acceptance probabilities, per node source, depth and score range.

    Builder scores are products of fused probabilities and per-depth discounts (or, for
    continuations, evidence estimates), so they rank nodes well but are not probabilities,
    and how far off they are depends on the score itself: one factor per depth, averaged over
    every node, overestimated the gain of high-scoring trees by 30-50% under load (and those
    are the trees the controller verifies). So the factor is kept per depth *and* per score
    bin (half-decade wide): ``factor[d, s] = accepted[d, s] / score_mass[d, s]`` over recent
    verified trees (exponentially decayed), where accepted counts the verified nodes of depth
    d and bin s that were accepted and score_mass sums their scores.

    And per *source* (the tree's ``sources`` bit mask: memory rows, the request's own
    continuation, the shared index, or several): the two kinds of score mean different
    things, and one factor for both was wrong for each. Measured at concurrency 4 (bf16
    SmolLM2, 26 Spec-Bench prompts x 64, every verified node's probability from the factors
    before its tree was observed): nodes from the memories alone were accepted 0.29x as often
    as estimated, the request's own continuations 0.82x and the shared index's 1.04x.

    Rare bins shrink to their source's pooled factor at that depth (``prior_nodes``
    pseudo-nodes per bin), that to every source's pooled factor at the depth
    (``prior_depth_mass`` pseudo-score), and that to ``prior[d]``, which undoes the discounts
    (``prior_depth_mass`` pseudo-score). Both depth priors carry down what the depth above
    learned (its pooled factor over its prior, and each source's over the pooled one): deep
    nodes have small scores, so a few pseudo-score outweighed hundreds of them, and at batch
    1 memory-only nodes of depth 4 and more were accepted 0.11x as often as estimated
    (0.79x with the ratio carried down, 14% fewer nodes verified for as many accepted).
    Trees without sources use class 0.

    Args:
        depth_discounts: the builder's discounts (`RecapConfig.depth_discounts`).
        prior_nodes: pseudo-nodes of a bin's prior (its source's pooled factor at its depth).
        decay: per-tree decay of past observations.
        prior_depth_mass: pseudo-score of a depth's priors.
    """

    # Bin s holds scores in [EDGES[s - 1], EDGES[s]); bin 0 below 1e-3, the last from 1.
    EDGES = 10.0 ** np.arange(-3.0, 0.25, 0.5)
    # A representative score per bin (the geometric middle), for the prior's pseudo-mass.
    MIDDLES = np.r_[5e-4, np.sqrt(EDGES[:-1] * EDGES[1:]), 1.0]
    # Source classes: every combination of the three SOURCE_* bits; 0 where not tracked.
    CLASSES = 8

    def __init__(self, depth_discounts: tuple[float, ...], prior_nodes: float = 2.0,
                 decay: float = 0.995, prior_depth_mass: float = 2.0) -> None:
        # [MAX_DEPTH + 1]: a node at depth d scores the product of d(1..d) times its fused
        # probabilities, so 1 / that product undoes the discounts (1 at the root).
        self.prior = 1.0 / np.cumprod(discount_table(depth_discounts))
        self.decay = decay
        shape = (self.CLASSES, MAX_DEPTH + 1, len(self.MIDDLES))
        self.accepted = np.zeros(shape)  # [classes, depths, bins]
        self.mass = np.zeros(shape)
        self._prior_mass = prior_nodes * self.MIDDLES  # [bins]
        self.prior_depth_mass = prior_depth_mass
        self._factors: np.ndarray | None = None  # cached until the next observation

    def factors(self) -> np.ndarray:
        """[classes, MAX_DEPTH + 1, bins] score -> probability factor (depth 0 unused).

        A bin's prior is its source's pooled factor at its depth, not the discounts: the
        discounts assume every fused probability is exact, which at depth 4-6 overrated the
        sparse bins of the large trees the controller verifies by ~2x under load."""
        if self._factors is None:
            self._factors = np.empty_like(self.accepted)
            kernels.calibration_factors(self.accepted, self.mass, self._prior_mass, self.prior,
                                        float(self.prior_depth_mass), self._factors)
        return self._factors

    def observe(self, depths: np.ndarray, scores: np.ndarray, accepted: np.ndarray,
                sources: np.ndarray | None = None) -> None:
        """One verified tree: node depths/scores/sources [n] (root included; sources as
        `DraftTree.sources`, None: untracked) and the indices of its accepted nodes (root
        excluded)."""
        self._factors = None
        depths = _ints(depths)
        kernels.calibration_observe(self.accepted, self.mass, float(self.decay), depths,
                                    _floats(scores), _classes(sources, depths.shape[0]),
                                    _ints(accepted).reshape(-1), self.EDGES, MAX_DEPTH)

    def node_probabilities(self, depths: np.ndarray, parents: np.ndarray,
                           scores: np.ndarray, sources: np.ndarray | None = None) -> np.ndarray:
        """[n] estimated P(node accepted), root 1; never above the parent's probability."""
        return np.array(self.probability_list(depths, parents, scores, sources))

    def probability_list(self, depths: np.ndarray, parents: np.ndarray,
                         scores: np.ndarray, sources: np.ndarray | None = None) -> list[float]:
        """:meth:`node_probabilities` as a Python list (what the controller works on)."""
        depths = _ints(depths)
        n = depths.shape[0]
        out = np.empty(n)
        kernels.calibration_probabilities(self.factors(), self.EDGES, depths, _ints(parents),
                                          _floats(scores), _classes(sources, n), MAX_DEPTH, out)
        return out.tolist()


def _classes(sources: np.ndarray | None, n: int) -> np.ndarray:
    """[n] int64 source classes of a tree's nodes (the kernels wrap any value into range)."""
    if sources is not None:
        return _ints(sources)
    return _UNTRACKED[:n] if n <= _UNTRACKED.shape[0] else np.zeros(n, np.int64)


_UNTRACKED = np.zeros(256, np.int64)  # class 0 for trees without sources (read-only use)


def _ints(a) -> np.ndarray:
    """int64 array (a no-op for the trees' own arrays: the kernels compile for int64 only)."""
    return a if isinstance(a, np.ndarray) and a.dtype == np.int64 else np.asarray(a, np.int64)


def _floats(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) and a.dtype == np.float64 else np.asarray(a, np.float64)


@dataclass(frozen=True)
class Decision:
    """What the controller expected of the level it chose, for :meth:`BudgetController.observe_outcome`.

    Attributes:
        level: the step's draft nodes in all (> 0).
        seconds: the cost model's estimate of the step that verifies the drafts.
        gain: the calibrated expected accepted drafts over the batch.
        chain: the drafts were chains (the best chain of each tree), not trees.
    """

    level: int
    seconds: float
    gain: float
    chain: bool = False

    def outcome(self, seconds: float, accepted: int) -> str:
        """One line on how the decision came out (the driver's DEBUG log): the step's
        estimate and expected drafts against its measured seconds and accepted drafts."""
        return (f"{_nodes_as(self.level, 'chains' if self.chain else 'trees')} estimated "
                f"{self.seconds * 1e3:.1f} ms for +{self.gain:.2f} tokens, ran "
                f"{seconds * 1e3:.1f} ms for +{accepted}")


class LevelOutcomes:
    """Measured over expected, per chosen level: step seconds and accepted drafts.

    The controller picks the level whose estimate looks best, and estimates are noisy, so the
    level it picks is more often over- than under-rated (the winner's curse). At concurrency
    4 (bf16, SmolLM2) steps of 6-16 nodes per request ran 25-50% dearer and accepted 25-40%
    fewer drafts than estimated, while small levels were on target. Learning the two ratios
    on the steps each level was actually chosen for corrects exactly that bias; a level that
    disappoints gets chosen less.

    A level's ratios shrink towards the pooled ratios of every level of its shape (trees or
    chains), and those towards 1. Under load the bias is shared: at concurrency 16 (bf16,
    SmolLM2) the drafted steps of every level ran 23% dearer than estimated in all, but spread
    over ~15 levels each was chosen a few times, so every level still looked unbiased when
    first chosen, and drafting, which broke even at best, ran at 0.92x of plain decoding
    while the same engine not drafting ran at 1.04x.
    """

    def __init__(self) -> None:
        # (level, chain) -> [weight, sum cost ratio, sum gain ratio]; Python floats, not
        # numpy: the controller reads ~20 of these a step, and numpy scalars made every
        # rate computed from them several times slower
        self._sums: dict[tuple[int, bool], list[float]] = {}
        # chain -> the same sums over every level of that shape
        self._pooled: dict[bool, list[float]] = {}

    @staticmethod
    def _shrunk(sums, prior: tuple[float, float]) -> tuple[float, float]:
        """(cost ratio, gain ratio) of [weight, sum cost, sum gain] sums, shrunk towards
        ``prior`` with ``OUTCOME_PRIOR_STEPS`` pseudo-steps."""
        w, cost, gain = sums
        n = w + OUTCOME_PRIOR_STEPS
        return ((cost + OUTCOME_PRIOR_STEPS * prior[0]) / n,
                (gain + OUTCOME_PRIOR_STEPS * prior[1]) / n)

    def pooled_ratios(self, chain: bool = False) -> tuple[float, float]:
        """(cost ratio, gain ratio) over every level of a shape, shrunk towards 1."""
        return self._shrunk(self._pooled.get(chain, (0.0, 0.0, 0.0)), (1.0, 1.0))

    def ratios(self, level: int, chain: bool = False) -> tuple[float, float]:
        """(cost ratio, gain ratio) of a level and shape: measured / estimated, shrunk
        towards the shape's pooled ratios."""
        return self.ratio_list([level], chain)[0]

    def ratio_list(self, levels: list[int], chain: bool = False) -> list[tuple[float, float]]:
        """:meth:`ratios` of several levels of one shape ((1, 1) for level 0: plain decoding
        has no estimate to correct)."""
        pooled = self.pooled_ratios(chain)
        return [(1.0, 1.0) if level == 0 else
                self._shrunk(self._sums.get((level, chain), (0.0, 0.0, 0.0)), pooled)
                for level in levels]

    def observe(self, decision: Decision, seconds: float, accepted: float) -> None:
        """One verified step chosen at ``decision.level``: its seconds and accepted drafts."""
        lo, hi = OUTCOME_CLIP
        cost = min(hi, max(lo, seconds / max(decision.seconds, 1e-9)))
        # accepted drafts over expected, on 1 + each so a small expectation cannot explode it
        gain = min(hi, max(lo, (1.0 + accepted) / (1.0 + decision.gain)))
        for sums in (self._sums.setdefault((decision.level, decision.chain), [0.0] * 3),
                     self._pooled.setdefault(decision.chain, [0.0] * 3)):
            sums[:] = [OUTCOME_DECAY * s + x for s, x in zip(sums, (1.0, float(cost), float(gain)))]


class BudgetController:
    """Chooses the per-request node count of each step (see the module docstring).

    Args:
        max_budget: most draft nodes per request (the configured node budget + suffix).
        depth_discounts: the builder's discounts (prior for the calibration).
    """

    def __init__(self, max_budget: int, depth_discounts: tuple[float, ...]) -> None:
        self.max_budget = max_budget
        self.cost = StepCostModel()
        self._discounts = depth_discounts
        # One calibration per acceptance rule: a sampled request goes deeper with the target
        # probability of the drafted children, a greedy one only when a child is the argmax,
        # so the same builder score is worth less under sampling (and it depends on the
        # temperature mix of the traffic, which the online calibration follows).
        self.calibrations: dict[str, AcceptanceCalibration] = {}
        self.outcomes = LevelOutcomes()
        self.last_choice = 0
        self.last_chain = False  # the last choice verifies chains (see ``choose``)
        self.last_counts: list[int] = []  # per request, the nodes of the last choice
        self.last_decision: Decision | None = None
        # What the last choice weighed, for :meth:`explain` (kept, not formatted: free
        # unless someone asks)
        self._last_candidates: list[tuple] = []
        self._last_pick: tuple | None = None  # the candidate the rates picked
        self._last_best: tuple | None = None  # the one chosen (a re-measurement may differ)
        self._last_unpriced: int | None = None  # tokens of a plain step with no price
        self._last_margin = 1.0
        self._last_drain = False

    def calibration(self, kind: str = "greedy") -> AcceptanceCalibration:
        """The calibration of one acceptance rule ("greedy" or "sampled")."""
        cal = self.calibrations.get(kind)
        if cal is None:
            cal = self.calibrations[kind] = AcceptanceCalibration(self._discounts)
        return cal

    def expected_gains(self, tree: DraftTree, kind: str = "greedy") -> np.ndarray:
        """[n] cumulative expected accepted tokens when verifying the first k nodes (k = index)."""
        return np.array(self._gains(tree, kind))

    def _gains(self, tree: DraftTree, kind: str) -> list[float]:
        p = self.calibration(kind).probability_list(tree.depths, tree.parents, tree.scores,
                                                    tree.sources)
        return [0.0, *accumulate(p[1:])]

    def choose(self, trees: list[DraftTree], fixed_tokens: int,
               kinds: list[str] | None = None, context: float = 0,
               chains: bool = False, drain: Drain | None = None) -> int:
        """Draft nodes per request for this step (and, with ``chains``, the shape).

        The step verifies D draft nodes in all, D from ``LEVELS``; they go to the requests
        whose next nodes are likeliest accepted (each request verifies a prefix of its
        best-first tree, so D is split by merging the requests' node probabilities, best
        first): under load one request's confident continuation gets nodes that another's
        guesses would waste, where one count for every request drafted both or neither.

        Args:
            trees: the proposed trees of the decoding requests (full budget, best first).
            fixed_tokens: tokens the step runs regardless (prefill chunks of other requests).
            kinds: per tree, its acceptance rule ("greedy" default, or "sampled").
            context: mean context length of the decoding requests (tokens).
            chains: also price every D as each tree's first path (`DraftTree.first_path`),
                against the chain-step costs (a tree's extra accepted tokens may not pay
                for its dearer pass); ``last_chain`` then says which shape won. Without it
                every drafted step is priced from the tree-step costs (``observe_step``'s
                default).
            drain: price by the steps taken off a draining batch's run (see :class:`Drain`;
                ``trees`` then are the longest requests'), not by committed tokens.

        Returns:
            The most nodes any request verifies; ``last_counts`` holds each request's (its
            tree's first nodes or, when ``last_chain``, its first path's).
        """
        self.last_chain = False
        self.last_counts = [0] * len(trees)
        self._last_candidates, self._last_unpriced = [], None
        self._last_pick = self._last_best = None
        if not trees:
            return 0
        kinds = kinds or ["greedy"] * len(trees)
        # Python lists and floats throughout: a few dozen numbers a step, where numpy's
        # per-call overhead was most of the controller's time (~0.25 ms a step).
        probs = [self.calibration(k).probability_list(t.depths, t.parents, t.scores, t.sources)
                 for t, k in zip(trees, kinds)]
        # a prefix of up to this many nodes is a single path (verified as a chain)
        straight = [t.leading_chain() for t in trees]
        cap = self.max_budget + 1
        shapes = [(False, [p[1:cap] for p in probs], straight)]  # (chain, node probs, straight)
        if chains:
            paths = [first_path_nodes(t.parents.tolist()) for t in trees]
            shapes.append((True, [[p[v] for v in path[:self.max_budget]]
                                  for p, path in zip(probs, paths)],
                           [len(path) for path in paths]))
        base_tokens = fixed_tokens + len(trees)
        # tokens a step commits without drafts, or, while draining, steps of the run
        served = len(trees) if drain is None else 1
        # (D, chain, tokens, tree, rate, (seconds, gain), order)
        candidates = []
        tree_shape: list[bool] = []  # per D, whether the tree candidate verifies a tree
        for chain, node_probs, shape_straight in shapes:
            order, gains, is_tree = _merge(node_probs, shape_straight)
            # what each level is worth: accepted drafts, or steps off a draining run
            worth = gains if drain is None else _drain_gains(order, node_probs, drain.slack)
            if not chain:
                tree_shape = is_tree
            total = len(order)
            # plain decoding, and in the chain shape the D whose tree candidate is this step
            levels = [d for d in sorted({d for d in LEVELS if d < total} | {total})
                      if not (chain and (d == 0 or (d < len(tree_shape) and not tree_shape[d])))]
            trees_at = [not chains or is_tree[d] for d in levels]
            estimates = self.cost.estimates(base_tokens, context, list(zip(levels, trees_at)))
            for level, tree, seconds, (cost_ratio, gain_ratio) in zip(
                    levels, trees_at, estimates, self.outcomes.ratio_list(levels, chain)):
                tokens = base_tokens + level
                if seconds is None or (level == 0 and not self.cost.priced(tokens, context)):
                    self._last_unpriced = tokens
                    self.last_choice, self.last_decision = 0, None  # plain decoding is
                    return 0                                        # priced first, always
                rate = (served + worth[level] * gain_ratio) / (seconds * cost_ratio)
                candidates.append((level, chain, tokens, tree, rate, (seconds, gains[level]),
                                   order))
        # Drafting must beat plain decoding by a margin: per-size step costs are noisy
        # (+-20% on a shared CPU), and a coin-flip win at best breaks even while paying for
        # the extra rows' proposer work, which the cost model does not see.
        margin = draft_margin(len(trees) if drain is None else drain.decoding)
        best = max(candidates, key=lambda c: c[4] if c[0] == 0 else c[4] / margin)
        self._last_candidates, self._last_pick, self._last_margin = candidates, best, margin
        self._last_drain = drain is not None
        choice, chosen_chain = best[0], best[1]
        # Now and then re-measure a neighbouring size whose measurement is missing, old or
        # contradicted by a larger size: the next one down first (a smaller size is only
        # measured when chosen, so one slow early step, e.g. in a burst of arrivals, would
        # otherwise price it out for good), else the next one up (optimistic extrapolation
        # needs a measurement to be corrected), else the other shape of the same size.
        if self.cost.steps % 8 == 0:
            same = [c for c in candidates if c[1] == chosen_chain]
            below = [c for c in same if c[0] < choice][-1:]
            above = [c for c in same if c[0] > choice][:1]
            other = [c for c in candidates if c[1] != chosen_chain and c[0] == choice]
            for candidate in below + above + other:
                level, tokens, tree = candidate[0], candidate[2], candidate[3]
                if (self.cost.is_stale(tokens, context, level, tree)
                        or self.cost.is_clamped(tokens, context, level, tree)):
                    best = candidate
                    break
        self._last_best = best
        level = best[0]
        counts = [0] * len(trees)
        for r in best[6][:level]:
            counts[r] += 1
        self.last_counts = counts
        self.last_choice = max(counts)
        self.last_chain = bool(best[1]) and level > 0
        self.last_decision = Decision(level, *best[5], self.last_chain) if level > 0 else None
        return self.last_choice

    def explain(self) -> str:
        """One line on the last :meth:`choose`: what it chose and against what -- plain
        decoding's estimate and rate, the best drafting candidate's (after the outcome
        corrections) and the margin it had to clear. For the operator asking why RECAP does
        or does not draft (the driver logs it at DEBUG level); built only when asked."""
        if self._last_unpriced is not None:
            n = self._last_unpriced
            return (f"declined: a plain step of {n} token{'' if n == 1 else 's'} has no price "
                    f"at this context yet (plain decoding is measured first)")
        if not self._last_candidates or self._last_best is None:
            return "nothing to choose (no trees)"
        best, pick = self._last_best, self._last_pick
        chosen = _described(best) if best[0] else "no drafts"
        if pick is not best:
            chosen += (f" (re-measuring; the rates picked "
                       f"{_described(pick) if pick[0] else 'no drafts'})")
        # rates are committed tokens per second, or, while the batch drains, steps taken
        # off its remaining run per second (see Drain)
        unit = "run steps/s" if self._last_drain else "tokens/s"
        plain = next(c for c in self._last_candidates if c[0] == 0)
        drafted = [c for c in self._last_candidates if c[0] > 0]
        text = f"chose {chosen}; plain {plain[5][0] * 1e3:.1f} ms, {plain[4]:.1f} {unit}"
        if drafted:
            top = max(drafted, key=lambda c: c[4])
            text += (f"; best draft {_described(top)}: "
                     f"{top[5][0] * 1e3:.1f} ms for +{top[5][1]:.2f} tokens, {top[4]:.1f} "
                     f"{unit} (must beat plain x{self._last_margin:.2f})")
        return text

    def observe_step(self, num_tokens: int, seconds: float, context: float = 0,
                     drafts: int = 0, work: float = 0.0, tree: bool = True) -> None:
        """One engine step: tokens run (``drafts`` of them draft tokens, ``tree``: verified
        as trees, else as chains), seconds, context, and the drafter's own part of the
        seconds (see `StepCostModel.observe`)."""
        self.cost.observe(num_tokens, seconds, context, drafts, work, tree)

    def observe_outcome(self, decision: Decision, seconds: float, accepted: int) -> None:
        """The step that verified the drafts of ``decision`` (``last_decision`` of the choice
        that scheduled them): its measured seconds and the drafts accepted over the batch."""
        self.outcomes.observe(decision, seconds, accepted)

    def observe_tree(self, parents: np.ndarray, scores: np.ndarray, accepted: int | np.ndarray,
                     depths: np.ndarray | None = None, kind: str = "greedy",
                     sources: np.ndarray | None = None) -> None:
        """One verified tree: parents/scores/depths/sources [n] of the verified nodes (root
        included; ``depths`` as `DraftTree.depths`, derived with `tree_depths` when not given;
        ``sources`` as `DraftTree.sources`), the accepted nodes (their indices, root excluded,
        or a count k for nodes 1..k: a chain or the best chain), and the acceptance rule it
        was verified by."""
        if len(parents) > 1:
            if depths is None:
                depths = tree_depths(parents)
            if np.isscalar(accepted):
                accepted = np.arange(1, int(accepted) + 1)
            self.calibration(kind).observe(depths, scores, accepted, sources)


def _described(candidate: tuple) -> str:
    """'<D> nodes as trees / chains / single paths' of a candidate of ``choose`` (a tree-shape
    candidate whose nodes form a single path per request verifies as chains do)."""
    level, chain, tree = candidate[0], candidate[1], candidate[3]
    return _nodes_as(level, "chains" if chain else ("trees" if tree else "single paths"))


def _nodes_as(level: int, shape: str) -> str:
    return f"{level} node{'' if level == 1 else 's'} as {shape}"


def _drain_gains(order: list[int], node_probs: list[list[float]], slack: float) -> list[float]:
    """[D + 1] steps the first d nodes of ``order`` (see :func:`_merge`) are expected to take
    off a draining run: the least expected accepted drafts of any request (all of them are
    the run's longest), at most ``slack``."""
    counts = [0] * len(node_probs)
    gains = [0.0] * len(node_probs)
    out = [0.0]
    for r in order:
        gains[r] += node_probs[r][counts[r]]
        counts[r] += 1
        out.append(min(slack, min(gains)))
    return out


def _merge(node_probs: list[list[float]], straight: list[int]
           ) -> tuple[list[int], list[float], list[bool]]:
    """The batch's draft nodes in the order the controller adds them.

    Each request verifies a prefix of its node list, so a request's nodes are ranked by the
    running minimum of their probabilities (never above an earlier node's) and the lists
    merged by that rank; ties go to the shallower node in its list, then the earlier request
    (estimates clipped at 1 tie often, and a request's deeper nodes are the less certain).

    Args:
        node_probs: per request, its draft nodes' P(accepted) in layout order.
        straight: per request, how many of its first nodes form a single path.

    Returns:
        order [D]: the request of each added node; gains [D + 1]: expected accepted nodes of
        the first d added (gains[0] = 0); is_tree [D + 1]: whether the first d added make
        some request's nodes more than a single path.
    """
    if len(node_probs) == 1:
        # One request (batch 1, the common case): its nodes in their own order, since the
        # rank (running minimum, then position) never reorders one list; the same sums as
        # the general loop, added in the same order.
        probs, line = node_probs[0], straight[0]
        return ([0] * len(probs), [0.0, *accumulate(probs)],
                [d > line for d in range(len(probs) + 1)])
    ranked = []
    for r, probs in enumerate(node_probs):
        low = 1.0
        for j, p in enumerate(probs):
            low = min(low, p)
            ranked.append((-low, j, r, p))
    ranked.sort()
    order, gains, is_tree = [], [0.0], [False]
    counts = [0] * len(node_probs)
    total, tree = 0.0, False
    for _, _, r, p in ranked:
        order.append(r)
        counts[r] += 1
        total += p
        tree = tree or counts[r] > straight[r]
        gains.append(total)
        is_tree.append(tree)
    return order, gains, is_tree
