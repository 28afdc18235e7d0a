"""How many draft nodes to verify per step: a measured cost model against calibrated gains.

Verifying more tree nodes costs target time; on a large GPU model almost nothing up to ~64
tokens, on a 2-core CPU a lot (the matrix kernels fall off a cliff between 1 and 2 rows). A
fixed budget is therefore right on one machine and wrong on the next, and wrong again as the
batch grows. The controller picks, every step, the per-request node count ``b`` that
maximises expected committed tokens per second of engine time:

    throughput(b) = sum_r (1 + E_r(b)) / T(fixed + sum_r (1 + b))

- ``T(n)``: seconds of one engine step that runs ``n`` tokens, learned online from the steps
  actually run (:class:`StepCostModel`). An unmeasured size between two measured ones is
  interpolated linearly (under load, steps with prefill chunks measure large sizes early, and
  calling everything below them as cheap as the smallest size made drafting look free); one
  above every measured size costs what the largest does (optimism), so larger budgets get
  tried, measured, and dropped if they do not pay. A size is re-measured now and then, since
  machines and loads drift.
- ``E_r(b)``: expected accepted tokens if request r verifies the first ``b`` nodes of its tree
  (layout order, parents first). Each node contributes P(node accepted), estimated from its
  builder score times a per-depth calibration factor learned from verified steps
  (:class:`AcceptanceCalibration`). Summing P(node accepted) over nodes gives the expected
  accepted length exactly, because at most one node per depth is accepted.

``b = 0`` (no speculation) is always a candidate, which is what keeps the policy from being
slower than plain decoding once its estimates are measured.
"""

from __future__ import annotations

import numpy as np

from vllm_recap.core.config import MAX_DEPTH, discount_table
from vllm_recap.core.tree import DraftTree, tree_depths

# Candidate per-request node counts (the controller also caps them at the configured budget).
LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# Expected throughput a drafting choice must exceed plain decoding's by (see ``choose``).
DRAFT_MARGIN = 1.03


class StepCostModel:
    """Seconds per engine step as a function of the tokens it runs and their context length.

    A verification pass's attention grows with the context each token attends to, so a tree
    size that pays at a 100-token context may not at 1,000: sizes are measured per context
    bucket (factor-2 wide, by the mean context of the step's decoding requests) and never
    borrowed from another bucket while this one has measurements of its own.

    Args:
        ema: weight of a new measurement in the per-size moving average.
        stale_after: a size measured this many steps ago is due for re-measurement.
    """

    def __init__(self, ema: float = 0.25, stale_after: int = 64) -> None:
        self.ema = ema
        self.stale_after = stale_after
        self._mean: dict[tuple[int, int], float] = {}  # (context bucket, size bucket) -> s
        self._last: dict[tuple[int, int], int] = {}
        self.steps = 0

    @staticmethod
    def bucket(num_tokens: int) -> int:
        """Sizes up to 16 exactly; larger ones in ~12% wide buckets (the cost changes slowly)."""
        if num_tokens <= 16:
            return num_tokens
        return int(round(16 * 1.125 ** round(np.log(num_tokens / 16) / np.log(1.125))))

    @staticmethod
    def context_bucket(context: float) -> int:
        """0 for none (prefill-only steps), else round(log2(context)): 64, 128, ... 4096."""
        return 0 if context < 1 else int(round(np.log2(max(context, 64.0))))

    def _key(self, num_tokens: int, context: float) -> tuple[int, int]:
        return self.context_bucket(context), self.bucket(num_tokens)

    def observe(self, num_tokens: int, seconds: float, context: float = 0) -> None:
        """Records one step that ran ``num_tokens`` tokens at mean ``context`` in ``seconds``."""
        self.steps += 1
        if num_tokens <= 0 or not np.isfinite(seconds) or seconds <= 0:
            return
        key = self._key(num_tokens, context)
        old = self._mean.get(key)
        # A stale or contradicted average is replaced, not blended: it may come from another
        # phase of the load, or from one slow step.
        blend = (old is not None and not self.is_stale(num_tokens, context)
                 and not self.is_clamped(num_tokens, context))
        self._mean[key] = old + self.ema * (seconds - old) if blend else seconds
        self._last[key] = self.steps

    def _buckets_by_distance(self, context: float) -> list[int]:
        """Measured context buckets, nearest to ``context``'s first (the larger on a tie)."""
        want = self.context_bucket(context)
        return sorted({c for c, _ in self._mean}, key=lambda c: (abs(c - want), -c))

    def _curve(self, ctx: int) -> tuple[np.ndarray, np.ndarray]:
        """(sizes, monotone seconds) measured in context bucket ``ctx``."""
        sizes = np.array(sorted(n for c, n in self._mean if c == ctx), dtype=np.float64)
        values = np.minimum.accumulate([self._mean[(ctx, int(n))] for n in sizes[::-1]])[::-1]
        return sizes, values

    def _sizes(self, context: float) -> tuple[np.ndarray, np.ndarray] | None:
        """Measured (sizes, monotone seconds) of the nearest context bucket with data."""
        if not self._mean:
            return None
        return self._curve(self._buckets_by_distance(context)[0])

    def _growth(self, context: float, own: tuple[np.ndarray, np.ndarray], size: float) -> float:
        """How much dearer ``size`` is than the largest size of the bucket ``own`` came from,
        by the nearest other context bucket that measured beyond it (1.0 if none did)."""
        top = own[0][-1]
        for ctx in self._buckets_by_distance(context)[1:]:
            sizes, values = self._curve(ctx)
            if sizes[-1] > top:
                return max(1.0, float(np.interp(size, sizes, values) / np.interp(top, sizes,
                                                                                 values)))
        return 1.0

    def estimate(self, num_tokens: int, context: float = 0) -> float | None:
        """Expected seconds for a step of ``num_tokens`` tokens (None before any measurement).

        Measured sizes use their average, made monotone from above (a size never costs more
        than a larger measured one: one slow step at a small size, say during a burst of
        arrivals, must not make the sizes above it look free). Sizes between two measured
        ones are interpolated linearly, sizes below the smallest cost what the smallest does.
        Sizes beyond the largest measured one grow from it as they grow in the nearest other
        context bucket that measured them (a new context bucket would otherwise price every
        larger size like its plain step, and under load, where the mean context keeps moving,
        exploring those sizes bucket after bucket cost more than drafting won); where no
        bucket measured them, they cost what the largest does (optimistic, so they get tried).
        """
        found = self._sizes(context)
        if found is None:
            return None
        sizes, values = found
        n = self.bucket(num_tokens)
        if n <= sizes[-1]:
            return float(np.interp(n, sizes, values))
        return float(values[-1]) * self._growth(context, found, n)

    def measured(self, num_tokens: int, context: float = 0) -> bool:
        """True if this size has its own measurement in this context bucket."""
        return self._key(num_tokens, context) in self._mean

    def is_clamped(self, num_tokens: int, context: float = 0) -> bool:
        """True if this size's own average is above its estimate (a larger size measured
        cheaper): one of the two measurements is off, and re-measuring this one settles it."""
        own = self._mean.get(self._key(num_tokens, context))
        return own is not None and own > 1.05 * self.estimate(num_tokens, context)

    def is_stale(self, num_tokens: int, context: float = 0) -> bool:
        """True if this size was never measured here or not for ``stale_after`` steps."""
        last = self._last.get(self._key(num_tokens, context))
        return last is None or self.steps - last > self.stale_after


class AcceptanceCalibration:
    """Maps builder scores to acceptance probabilities, one factor per depth.

    Builder scores are products of fused probabilities and per-depth discounts, so they rank
    nodes well but are not probabilities. For depth d, ``factor[d] = accepted[d] /
    score_mass[d]`` over recent verified trees (exponentially decayed), where accepted[d]
    counts steps that accepted a node at depth d and score_mass[d] sums the scores of the
    verified nodes at depth d. A prior of ``prior_mass`` pseudo-score at ratio ``prior[d]``
    (undoing the discounts) keeps early estimates sane.

    Args:
        depth_discounts: the builder's discounts (`RecapConfig.depth_discounts`).
        prior_mass: pseudo-score of the prior per depth.
        decay: per-tree decay of past observations.
    """

    def __init__(self, depth_discounts: tuple[float, ...], prior_mass: float = 2.0,
                 decay: float = 0.995) -> None:
        # [MAX_DEPTH + 1]: a node at depth d scores the product of d(1..d) times its fused
        # probabilities, so 1 / that product undoes the discounts (1 at the root).
        self.prior = 1.0 / np.cumprod(discount_table(depth_discounts))
        self.prior_mass = prior_mass
        self.decay = decay
        self.accepted = np.zeros(MAX_DEPTH + 1)
        self.mass = np.zeros(MAX_DEPTH + 1)

    def factors(self) -> np.ndarray:
        """[MAX_DEPTH + 1] score -> probability factor per depth (index 0 unused)."""
        return (self.accepted + self.prior_mass * self.prior) / (self.mass + self.prior_mass)

    def observe(self, depths: np.ndarray, scores: np.ndarray, num_accepted: int) -> None:
        """One verified tree: node depths/scores (root included) and tokens accepted."""
        self.accepted *= self.decay
        self.mass *= self.decay
        d = np.minimum(depths[1:], MAX_DEPTH)
        np.add.at(self.mass, d, scores[1:])
        self.accepted[1:min(num_accepted, MAX_DEPTH) + 1] += 1.0

    def node_probabilities(self, depths: np.ndarray, parents: np.ndarray,
                           scores: np.ndarray) -> np.ndarray:
        """[n] estimated P(node accepted), root 1; never above the parent's probability."""
        p = np.minimum(1.0, self.factors()[np.minimum(depths, MAX_DEPTH)] * scores)
        p[0] = 1.0
        for i in range(1, len(p)):
            p[i] = min(p[i], p[parents[i]])
        return p


class BudgetController:
    """Chooses the per-request node count of each step (see the module docstring).

    Args:
        max_budget: most draft nodes per request (the configured node budget + suffix).
        depth_discounts: the builder's discounts (prior for the calibration).
    """

    def __init__(self, max_budget: int, depth_discounts: tuple[float, ...]) -> None:
        self.levels = sorted({b for b in LEVELS if b <= max_budget} | {max_budget})
        self.cost = StepCostModel()
        self._discounts = depth_discounts
        # One calibration per acceptance rule: a sampled request goes deeper with the target
        # probability of the drafted children, a greedy one only when a child is the argmax,
        # so the same builder score is worth less under sampling (and it depends on the
        # temperature mix of the traffic, which the online calibration follows).
        self.calibrations: dict[str, AcceptanceCalibration] = {}
        self.last_choice = 0

    def calibration(self, kind: str = "greedy") -> AcceptanceCalibration:
        """The calibration of one acceptance rule ("greedy" or "sampled")."""
        cal = self.calibrations.get(kind)
        if cal is None:
            cal = self.calibrations[kind] = AcceptanceCalibration(self._discounts)
        return cal

    def expected_gains(self, tree: DraftTree, kind: str = "greedy") -> np.ndarray:
        """[n] cumulative expected accepted tokens when verifying the first k nodes (k = index)."""
        p = self.calibration(kind).node_probabilities(tree.depths, tree.parents, tree.scores)
        p[0] = 0.0
        return np.cumsum(p)

    def choose(self, trees: list[DraftTree], fixed_tokens: int,
               kinds: list[str] | None = None, context: float = 0) -> int:
        """Per-request node count for this step.

        Args:
            trees: the proposed trees of the decoding requests (full budget).
            fixed_tokens: tokens the step runs regardless (prefill chunks of other requests).
            kinds: per tree, its acceptance rule ("greedy" default, or "sampled").
            context: mean context length of the decoding requests (tokens).

        Returns:
            b: verify the first b draft nodes of every tree (fewer if a tree is smaller).
        """
        if not trees:
            return 0
        kinds = kinds or ["greedy"] * len(trees)
        gains = [self.expected_gains(t, k) for t, k in zip(trees, kinds)]
        sizes = np.array([t.num_drafts for t in trees])
        base_tokens = fixed_tokens + len(trees)
        candidates = []  # (level, tokens, rate)
        previous = -1
        for b in self.levels:
            used = np.minimum(sizes, b)
            if int(used.sum()) == previous:
                break  # every tree is smaller than this level: nothing new to verify
            previous = int(used.sum())
            tokens = base_tokens + previous
            seconds = self.cost.estimate(tokens, context)
            if seconds is None or (b == 0 and not self.cost.measured(tokens, context)):
                self.last_choice = 0  # plain decoding is measured first, in every context
                return 0
            value = len(trees) + sum(float(g[u]) for g, u in zip(gains, used))
            candidates.append((b, tokens, value / seconds))
        # Drafting must beat plain decoding by a margin: per-size step costs are noisy
        # (+-20% on a shared CPU), and a coin-flip win at best breaks even while paying for
        # the extra rows' proposer work, which the cost model does not see.
        best = max(candidates, key=lambda c: c[2] if c[0] == 0 else c[2] / DRAFT_MARGIN)
        choice = best[0]
        # Now and then re-measure a neighbouring size whose measurement is missing, old or
        # contradicted by a larger size: the next one down first (a smaller size is only
        # measured when chosen, so one slow early step, e.g. in a burst of arrivals, would
        # otherwise price it out for good), else the next one up (optimistic extrapolation
        # needs a measurement to be corrected).
        if self.cost.steps % 8 == 0:
            below = [c for c in candidates if c[0] < choice][-1:]
            above = [c for c in candidates if c[0] > choice][:1]
            for level, tokens, _ in below + above:
                if self.cost.is_stale(tokens, context) or self.cost.is_clamped(tokens, context):
                    choice = level
                    break
        self.last_choice = choice
        return choice

    def observe_step(self, num_tokens: int, seconds: float, context: float = 0) -> None:
        self.cost.observe(num_tokens, seconds, context)

    def observe_tree(self, parents: np.ndarray, scores: np.ndarray, num_accepted: int,
                     depths: np.ndarray | None = None, kind: str = "greedy") -> None:
        """One verified tree: parents/scores/depths [n] of the verified nodes (root included;
        ``depths`` as `DraftTree.depths`, derived with `tree_depths` when not given), the
        draft tokens accepted, and the acceptance rule it was verified by."""
        if len(parents) > 1:
            if depths is None:
                depths = tree_depths(parents)
            self.calibration(kind).observe(depths, scores, num_accepted)
