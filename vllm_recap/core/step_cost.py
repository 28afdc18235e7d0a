"""What an engine step costs: seconds by tokens, draft tokens and context, learned online.

The node budget (:mod:`vllm_recap.core.budget`) weighs expected accepted tokens against these
estimates. Two tables per context bucket: plain steps (no drafts; RECAP's own work taken out,
since not drafting means idling) and the extra cost of draft tokens on top of them.
"""

from __future__ import annotations

import math
from bisect import bisect_left

import numpy as np

_LOG_1125 = math.log(1.125)


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """``np.interp`` for one point over short Python lists (the controller asks ~15 times a
    step; numpy's call overhead was most of the controller's time)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_left(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    if x == x1:
        return ys[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


class _CostTable:
    """Moving averages of one cost quantity keyed by (context bucket, size bucket).

    Args:
        origin: the quantity is 0 at size 0 (extra cost of drafts): sizes below the smallest
            measured one are interpolated from (0, 0) and sizes above the largest grow in
            proportion; otherwise (whole steps) they cost what the smallest / largest do.
    """

    def __init__(self, origin: bool) -> None:
        self.origin = origin
        self.mean: dict[tuple[int, int], float] = {}  # (context bucket, size bucket) -> s
        self.last: dict[tuple[int, int], int] = {}
        # Derived per context bucket, kept until the next observation: the controller asks
        # for ~15 estimates per step and the table changes once per step.
        self._curves: dict[int, tuple[list[float], list[float]]] = {}
        self._slopes: dict[int, float | None] = {}
        self._orders: dict[int, list[int]] = {}
        # (context bucket, size) -> priced_estimate: a step asks the same ~20 prices of a
        # table (twice over when it weighs chains too), and a table not observed since keeps
        # them; at batch 1 they were ~40% of the controller's time (SmolLM2, AVX2).
        self._prices: dict[tuple[int, int], tuple[float | None, bool]] = {}

    def observe(self, key: tuple[int, int], seconds: float, step: int, ema: float,
                stale: bool, clamped: bool) -> None:
        old = self.mean.get(key)
        # A stale or contradicted average is replaced, not blended: it may come from another
        # phase of the load, or from one slow step.
        blend = old is not None and not stale and not clamped
        self.mean[key] = old + ema * (seconds - old) if blend else seconds
        self.last[key] = step
        self._curves.clear()
        self._slopes.clear()
        self._orders.clear()
        self._prices.clear()

    def buckets_by_distance(self, ctx: int) -> list[int]:
        """Measured context buckets, nearest to ``ctx`` first (the larger on a tie)."""
        order = self._orders.get(ctx)
        if order is None:
            order = self._orders[ctx] = sorted({c for c, _ in self.mean},
                                               key=lambda c: (abs(c - ctx), -c))
        return order

    def curve(self, ctx: int) -> tuple[list[float], list[float]]:
        """(sizes, monotone seconds) measured in context bucket ``ctx``: a size never costs
        more than a larger measured one (one slow step at a small size, say during a burst of
        arrivals, must not make the sizes above it look free); an extra-cost table's curve
        starts at (0, 0)."""
        cached = self._curves.get(ctx)
        if cached is not None:
            return cached
        sizes = sorted(n for c, n in self.mean if c == ctx)
        values, low = [], math.inf
        for n in reversed(sizes):  # monotone: the running minimum from the largest size down
            low = min(low, self.mean[(ctx, n)])
            values.append(low)
        values.reverse()
        sizes = [float(n) for n in sizes]
        if self.origin:  # an extra cost: 0 at size 0, never negative
            sizes, values = [0.0, *sizes], [0.0, *(max(v, 0.0) for v in values)]
        self._curves[ctx] = sizes, values
        return sizes, values

    def slope(self, ctx: int) -> float | None:
        """Least-squares seconds per size unit over context bucket ``ctx``'s own averages
        (not the monotone curve, whose running minimum flattens it), at least 0; None with
        fewer than two sizes. Kept until the next observation, as the curves."""
        if ctx in self._slopes:
            return self._slopes[ctx]
        points = [(float(n), v) for (c, n), v in self.mean.items() if c == ctx]
        slope = None
        if len(points) >= 2:
            mx = sum(n for n, _ in points) / len(points)
            my = sum(v for _, v in points) / len(points)
            var = sum((n - mx) ** 2 for n, _ in points)
            cov = sum((n - mx) * (v - my) for n, v in points)
            slope = max(0.0, cov / var)
        self._slopes[ctx] = slope
        return slope

    def estimate(self, ctx: int, size: int) -> float | None:
        """Seconds at ``size`` from the nearest context bucket with data (None: no data).

        Between measured sizes: linear. Beyond the largest measured one it grows as it grows
        in the nearest other context bucket that measured on both sides of it; where none
        did, an extra cost grows in proportion to the size, and a whole step by the slope of
        this bucket's own measurements (flat with a single size: optimistic, so larger sizes
        get tried and measured). The slope matters under load: at concurrency 16 (2-core
        CPU, bf16) a decode step ran ~1.4 ms more per token from 3 to 16 tokens, and priced
        flat beyond 16, the first drafts of every size looked free and cost 25-80% more
        than estimated. Below the smallest measured size a whole step shrinks as it shrinks
        in another bucket measured on both sides (the one measured furthest down,
        :meth:`_shrunk`), else it costs what the smallest does.
        """
        return self.priced_estimate(ctx, size)[0]

    def priced_estimate(self, ctx: int, size: int) -> tuple[float | None, bool]:
        """(:meth:`estimate`, whether it is a *price*: interpolated, not extrapolated, and
        anchored at this context).

        Priced: between sizes this bucket measured; or beyond them, this bucket's nearest
        measured size grown or shrunk as the cost changes between the two sizes in another
        decode bucket that measured on both sides of that nearest size (growing: the nearest;
        shrinking: the one measured furthest down; the shape borrowed, the level this
        context's own), where that bucket measured ``size`` too; with no data here at all,
        the nearest bucket's values stand in, priced when that bucket is adjacent. Not
        priced: anything extrapolated beyond every measurement used, levels from a bucket two
        or more away, shapes from prefill-only steps (context bucket 0) for a decode bucket.
        The bucket lending a shape is chosen without looking at ``size``, so the estimate
        stays monotone in the size."""
        key = (ctx, size)
        price = self._prices.get(key)
        if price is None:
            price = self._prices[key] = self._priced_estimate(ctx, size)
        return price

    def _priced_estimate(self, ctx: int, size: int) -> tuple[float | None, bool]:
        order = self.buckets_by_distance(ctx)
        if not order:
            return None, False
        own = order[0]  # this bucket, or the nearest with data when it has none
        anchored = abs(own - ctx) <= 1
        sizes, values = self.curve(own)
        if sizes[0] <= size <= sizes[-1]:
            return float(_interp(size, sizes, values)), anchored
        scaled = self._scaled(order, sizes, values, size)
        if scaled is not None:
            value, source = scaled
            return value, anchored and source is not None and (source > 0 or ctx == 0)
        if size > sizes[-1]:
            return self._extended(own, size), False
        return float(values[0]), False

    def _scaled(self, order: list[int], sizes: list[float], values: list[float],
                size: int) -> tuple[float, int | None] | None:
        """``order[0]``'s nearest measured size to ``size`` (beyond its measured sizes; its
        curve is ``sizes``, ``values``), grown to ``size`` as the nearest other bucket that
        measured on both sides of that nearest size changes from it to ``size``, or shrunk
        (:meth:`_shrunk`); (value, that bucket, or None where ``size`` is beyond its
        measurements too), None where no bucket did."""
        up = size > sizes[-1]
        edge = sizes[-1] if up else sizes[0]
        if not up:
            return None if self.origin else self._shrunk(order, values[0], edge, size)
        for other in order[1:]:
            o_sizes, o_values = self.curve(other)
            # a curve is flat beyond its measured sizes, so its change from ``edge`` to
            # ``size`` means something only where it measured beyond ``edge`` too
            if o_sizes[0] <= edge < o_sizes[-1]:
                base = _interp(edge, o_sizes, o_values)
                grown = self._extended(other, size)
                source = other if size <= o_sizes[-1] else None
                if self.origin:
                    return float(values[-1] + max(0.0, grown - base)), source
                if base <= 0:
                    return float(values[-1]), None
                return float(values[-1] * max(1.0, grown / base)), source
        return None

    def _shrunk(self, order: list[int], value: float, edge: float, size: int
                ) -> tuple[float, int | None] | None:
        """A whole step below ``order[0]``'s smallest measured size ``edge`` (costing
        ``value``): ``value`` shrunk to ``size`` as it shrinks in the bucket that measured on
        both sides of ``edge`` and furthest below it -- a decode bucket before prefill-only
        steps' (bucket 0) for a decode bucket, the nearest among equals; (value, that bucket,
        or None where ``size`` is below its measurements too), None where no bucket did.

        Not simply the nearest such bucket: it may have measured down to 6 tokens where a
        bucket further off measured 1, and then a batch of 4 decodes was never priced
        (forced declines in the decision log, Intel Xeon, concurrency 8). The lender is
        still chosen without looking at ``size``, so the estimate stays monotone in it."""
        lender, rank = None, None
        for other in order[1:]:
            o_sizes, o_values = self.curve(other)
            if o_sizes[0] < edge <= o_sizes[-1]:
                key = (other == 0 and order[0] != 0, o_sizes[0])
                if rank is None or key < rank:  # strictly: the nearest among equals
                    lender, rank = (other, o_sizes, o_values), key
        if lender is None:
            return None
        other, o_sizes, o_values = lender
        base = _interp(edge, o_sizes, o_values)
        if base <= 0:
            return None
        shrunk = _interp(size, o_sizes, o_values) / base
        return float(value * min(1.0, shrunk)), other if size >= o_sizes[0] else None

    def _extended(self, ctx: int, size: float) -> float:
        """Bucket ``ctx``'s curve at ``size``, carried on beyond its largest size (an extra
        cost in proportion to the size, a whole step by the bucket's slope). A bucket lent
        its growth to another used to stop growing at its own largest size, so sizes beyond
        both looked as cheap as that one."""
        sizes, values = self.curve(ctx)
        top = sizes[-1]
        if size <= top:
            return float(_interp(size, sizes, values))
        if self.origin:
            return float(values[-1] * size / top)
        return float(values[-1] + (self.slope(ctx) or 0.0) * (size - top))


class StepCostModel:
    """Seconds per engine step as a function of its tokens, its draft tokens and context.

    Two tables, both per context bucket (a verification pass's attention grows with the
    context each token attends to, so a tree size that pays at a 100-token context may not
    at 1,000; sizes are never borrowed from another bucket while this one has its own):

    - *plain*: steps without drafts, by the tokens they run (decodes and prefill chunks).
    - *extra*: what a step's draft tokens add on top of the plain cost of its other tokens,
      by draft-token count (a drafted step's seconds minus the plain estimate of its other
      tokens). A draft token costs more than a prefill token (tree attention over its path,
      its logits row, top-K and acceptance), so pricing drafts off the plain table -- which
      under load is full of cheap prefill steps of the same token count -- made trees look
      cheap at concurrency 4 and chose 48 draft tokens for a step that cost 3.3x a plain one.
      Until extra costs are measured they are priced as plain tokens (optimistic, so drafts
      get tried and measured), and once measured never below that: the extra costs are keyed
      by draft count, not batch, and mostly measured at batch 1, where drafts ride along
      almost free.

    The extra cost is kept apart for steps that verify trees and steps whose drafts are all
    chains: a tree runs its own attention path and acceptance (bf16 SmolLM2, 2-core EPYC: a
    4-node tree pass cost ~13% more than a 4-token chain pass), so the controller can weigh a
    tree against the chain it contains (:meth:`BudgetController.choose`).

    Args:
        ema: weight of a new measurement in the per-size moving average.
        stale_after: a size measured this many steps ago is due for re-measurement.
    """

    def __init__(self, ema: float = 0.25, stale_after: int = 64) -> None:
        self.ema = ema
        self.stale_after = stale_after
        self.plain = _CostTable(origin=False)
        self.extra = _CostTable(origin=True)  # steps with a tree
        self.extra_chain = _CostTable(origin=True)  # drafted steps without one
        self.steps = 0

    @staticmethod
    def bucket(num_tokens: int) -> int:
        """Sizes up to 16 exactly; larger ones in ~12% wide buckets (the cost changes slowly)."""
        if num_tokens <= 16:
            return num_tokens
        return int(round(16 * 1.125 ** round(math.log(num_tokens / 16) / _LOG_1125)))

    @staticmethod
    def context_bucket(context: float) -> int:
        """0 for none (prefill-only steps), else round(log2(context)): 64, 128, ... 4096."""
        return 0 if context < 1 else int(round(math.log2(max(context, 64.0))))

    def _table(self, drafts: int, tree: bool = True) -> tuple[_CostTable, int]:
        if drafts <= 0:
            return self.plain, 0
        return (self.extra if tree else self.extra_chain), drafts

    def observe(self, num_tokens: int, seconds: float, context: float = 0,
                drafts: int = 0, work: float = 0.0, tree: bool = True) -> None:
        """Records one step that ran ``num_tokens`` tokens, ``drafts`` of them draft tokens
        (``tree``: some request verified a tree, else all drafts were chains), at mean decode
        ``context``, in ``seconds``, ``work`` of which was the drafter's own (rows, memory
        updates, proposals).

        A step without drafts is recorded without the drafter's work: not drafting means
        idling (the driver then skips that work), so that is what plain decoding costs. At
        concurrency 4 the work was ~4 ms of a 29 ms step, and drafting one node per request
        looked like a win against the 29 ms while it was a loss against the 25 ms of idling.
        A drafted step keeps it: it is part of what drafting costs."""
        self.steps += 1
        if drafts <= 0:
            seconds -= work
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        ctx = self.context_bucket(context)
        if drafts > 0:
            plain = self.plain.estimate(ctx, self.bucket(num_tokens - drafts))
            if plain is None:
                return  # nothing to take the extra cost from yet
            seconds -= plain
        stale = self.is_stale(num_tokens, context, drafts, tree)
        clamped = self.is_clamped(num_tokens, context, drafts, tree)
        table, size = self._table(drafts, tree)
        table.observe((ctx, self.bucket(size if drafts else num_tokens)), seconds, self.steps,
                      self.ema, stale, clamped)

    def estimate(self, num_tokens: int, context: float = 0, drafts: int = 0,
                 tree: bool = True) -> float | None:
        """Expected seconds for a step of ``num_tokens`` tokens, ``drafts`` of them draft
        tokens verified as trees (``tree``) or chains (None before any plain measurement)."""
        return self.estimates(num_tokens - drafts, context, [(drafts, tree)])[0]

    def estimates(self, base_tokens: int, context: float,
                  sizes: list[tuple[int, bool]]) -> list[float | None]:
        """:meth:`estimate` of a step of ``base_tokens`` plus ``drafts`` draft tokens
        verified as trees or not, per (drafts, tree) of ``sizes``; the work every size
        repeats (buckets, the plain cost of the base tokens) is done once (the budget prices
        ~15 sizes a step)."""
        ctx = self.context_bucket(context)
        base = self.plain.estimate(ctx, self.bucket(base_tokens))
        out: list[float | None] = []
        for drafts, tree in sizes:
            if base is None or drafts <= 0:
                out.append(base)
                continue
            extra = (self.extra if tree else self.extra_chain).estimate(ctx, self.bucket(drafts))
            plain = self.plain.estimate(ctx, self.bucket(base_tokens + drafts))
            # Never measured: priced as plain tokens. Measured: never below that either. The
            # extra table is keyed by draft count, not by batch, and its sizes are measured
            # where they were chosen -- at batch 1 a few drafts fill the kernels' idle rows
            # almost free -- so at concurrency 16 it priced 50 drafts at 2 ms over the plain
            # 16-token step (24 ms in all) where the step cost 44 ms, as 66 plain tokens do.
            out.append(plain if extra is None else max(base + extra, plain))
        return out

    def _key(self, num_tokens: int, context: float, drafts: int,
             tree: bool = True) -> tuple[_CostTable, tuple]:
        table, size = self._table(drafts, tree)
        return table, (self.context_bucket(context), self.bucket(size if drafts else num_tokens))

    def measured(self, num_tokens: int, context: float = 0, drafts: int = 0,
                 tree: bool = True) -> bool:
        """True if this size has its own measurement in this context bucket."""
        table, key = self._key(num_tokens, context, drafts, tree)
        return key in table.mean

    def priced(self, num_tokens: int, context: float = 0) -> bool:
        """True if the plain estimate of this size is a price (see
        `_CostTable.priced_estimate`): interpolated between sizes measured at this context,
        or its nearest measured size scaled by another decode bucket's shape, or, with
        nothing measured here, the adjacent bucket's interpolated value; not extrapolated,
        not from a context further away.

        A size that only occurs between a request's finish and its replacement's prefill
        (3 decodes at concurrency 4) is never measured itself: the next step runs the new
        request's prefill chunk too. And each time the batch's mean context moves into
        another log2 bucket, the sizes measured in the bucket it left are not yet measured
        in the new one, while a drafting batch measures plain steps only when it declines
        (a decline is measured after the next decision, so each crossing declined at least
        twice). Requiring this bucket's own measurement declined 32 of ~300 proposing steps
        in a concurrency-4 run (Intel Xeon, bf16 SmolLM2), 20 of 287 with sizes between
        measured ones priced, and the idle mode counted those declines as load."""
        return self.plain.priced_estimate(self.context_bucket(context),
                                          self.bucket(num_tokens))[1]

    def is_clamped(self, num_tokens: int, context: float = 0, drafts: int = 0,
                   tree: bool = True) -> bool:
        """True if this size's own average is above its estimate (a larger size measured
        cheaper): one of the two measurements is off, and re-measuring this one settles it."""
        table, key = self._key(num_tokens, context, drafts, tree)
        own = table.mean.get(key)
        return own is not None and own > 1.05 * table.estimate(*key) + 1e-9

    def is_stale(self, num_tokens: int, context: float = 0, drafts: int = 0,
                 tree: bool = True) -> bool:
        """True if this size was never measured here or not for ``stale_after`` steps."""
        table, key = self._key(num_tokens, context, drafts, tree)
        last = table.last.get(key)
        return last is None or self.steps - last > self.stale_after
