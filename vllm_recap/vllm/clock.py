"""Step timing: what an engine step cost (for the node budget) and what RECAP's part was.

The budget controller learns the cost of a step as a function of the tokens it ran. The
runner seams see the start of each step (``begin_step``); a step's duration is the time to
the next step's start, unless the engine sat idle in between (then it is unknown and
skipped). Prompt seeding runs in some steps only and does not depend on the draft count, so
its time is taken out: otherwise the size measured in a seeding step looks dear for long. A
step whose prompt rows rode along with its own LM-head call has the rows' share of that call
taken out as well (:class:`LmHeadTimes`), or is skipped where that share cannot be told.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from vllm_recap.vllm.context import StepTiming

# A gap longer than this between one step's end and the next one's start is idle time.
IDLE_GAP_S = 0.25


class StepClock:
    """Measures engine steps and RECAP's own work per step.

    Attributes:
        work_seconds: RECAP's work per engine step (layout, rows, acceptance, memory updates,
            drafting), the last 4096 steps, for the benchmarks' p50/p99 proposer cost.
        seeding_seconds: the prompt-seeding part of each of those steps (same steps, same
            order): which of the slow steps are the ones that computed prompt rows.
    """

    def __init__(self, history: int = 4096) -> None:
        self.work_seconds: deque[float] = deque(maxlen=history)
        self.seeding_seconds: deque[float] = deque(maxlen=history)
        self._begin: float | None = None
        self._end = 0.0
        self._tokens = 0
        self._drafts = 0
        self._tree = False
        self._context = 0.0
        self._excluded = 0.0
        self._work = 0.0
        self._shared = False
        # (tokens, tree) of drafted steps whose first step has run: the first drafted pass of
        # a new shape pays one-time costs (the CPU's matmul kernels are set up per row count,
        # the tree path's buffers are allocated). Measured: the first drafted step of a fresh
        # engine (24 nodes at batch 2) ran at >= 3x its estimate, and that one sample set the
        # budget's tree cost ratio to 1.5 for the rest of the run, which then idled in 680 to
        # 777 of ~870 steps (benchmarks.proposer_profile --sampling qwen_vl; 64-469 without
        # it). Steps without drafts are always reported: the budget measures those first.
        self._shapes: set[tuple[int, bool]] = set()

    def step_started(self, num_tokens: int, context: float, drafts: int = 0,
                     tree: bool = False) -> tuple[int, float, float, int, float, bool] | None:
        """Marks the start of a step that runs ``num_tokens`` tokens, ``drafts`` of them draft
        tokens, at mean ``context``; ``tree``: some request verifies a tree.

        Returns:
            (tokens, seconds, context, drafts, work, tree) of the previous step -- ``work`` is
            RECAP's own part of its seconds (seeding excluded from both) -- or None when it is
            unknown (first step, the engine was idle before this one, prompt rows rode
            along with its LM-head call, or it was the first drafted step of its shape).
        """
        now = time.perf_counter()
        previous = None
        shape = (self._tokens, self._tree)
        if (self._begin is not None and now - self._end < IDLE_GAP_S and not self._shared
                and (self._drafts == 0 or shape in self._shapes)):
            previous = (self._tokens, now - self._begin - self._excluded, self._context,
                        self._drafts, self._work, self._tree)
        if self._begin is not None and self._drafts > 0:
            self._shapes.add(shape)
        self._begin, self._tokens, self._excluded, self._work = now, num_tokens, 0.0, 0.0
        self._drafts, self._tree, self._shared = drafts, tree, False
        self._context = context
        return previous

    def step_finished(self, timing: StepTiming) -> None:
        """Records the step's RECAP work; its seeding time is left out of the step cost."""
        self._end = time.perf_counter()
        self._excluded = timing.seeding
        self._shared = timing.shared_lm_head
        self._work = max(0.0, timing.work - timing.seeding)
        self.work_seconds.append(timing.work)
        self.seeding_seconds.append(timing.seeding)


class LmHeadTimes:
    """Seconds of the target's own LM-head calls by row count, to tell the share of prompt
    rows that rode along with a step's call (``StepDriver._logits``), and to price more rows
    in a step's call before it runs (:meth:`growth`, for the prompt seeder).

    The rows' share of such a call is its time less what a call of the step's own rows
    alone takes: interpolated between the row counts measured next below and above it, or
    the one below when none above was measured (a call is not cheaper for more rows, so this
    errs towards taking out too much: the step then counts at most what it would have cost
    without the rows, and plain decoding, if anything, looks a little cheap -- never
    drafting). Host-side timing, so CPU calls only: on a device the call returns before its
    kernels have run.

    Why it matters: on a CPU every step of a burst of arrivals carries prompt rows (at
    concurrency 8, 16 rows a step for 10-15 steps), and with those steps unmeasured the budget
    could not price plain decoding for the batch's size, declined every draft, and the idle
    mode took those declines for load: every concurrency-8 run (Intel Xeon, bf16 SmolLM2)
    idled right after its first arrivals, and some never drafted again.

    Args:
        decay: weight of the old mean per new call of the same row count.
    """

    def __init__(self, decay: float = 0.8) -> None:
        self.decay = decay
        self._mean: dict[int, float] = {}

    def observe(self, rows: int, seconds: float) -> None:
        """One call of ``rows`` rows (a call's cost depends on its row count only, so a call
        that carried prompt rows is a sample of its whole row count)."""
        old = self._mean.get(rows)
        self._mean[rows] = seconds if old is None else old + (1.0 - self.decay) * (seconds - old)

    def estimate(self, rows: int) -> float | None:
        """Seconds of a call of ``rows`` rows (see the class docstring); None before any call
        of at most that many rows was measured."""
        below = max((r for r in self._mean if r <= rows), default=None)
        if below is None:
            return None
        above = min((r for r in self._mean if r >= rows), default=None)
        lo = self._mean[below]
        if above is None or above == below:
            return lo
        return lo + (self._mean[above] - lo) * (rows - below) / (above - below)

    def growth(self, rows: int, more: np.ndarray) -> np.ndarray | None:
        """[m] seconds a call of ``rows`` rows grows by when it carries ``more`` ([m] ints
        >= 0) rows besides: interpolated between measured row counts, flat beyond them (so a
        row count above all measured ones is priced as the largest, and is then measured);
        never negative. None before any call was measured.

        Why by measured counts rather than a cost per row: on a CPU the LM head's time is a
        staircase in its rows (Gemma-3-270M, bf16, Intel Xeon: ~14.0 ms flat from 1 to 11
        rows, 14.7 at 12-16, 16.5 at 17-24, 17.8 at 40, 28 at 64; SmolLM2's 1-row call is
        dearer than its 2-row one), so the same rows are nearly free in one step and dear in
        the next."""
        if not self._mean:
            return None
        counts = np.array(sorted(self._mean), dtype=np.float64)
        seconds = np.array([self._mean[int(r)] for r in counts])
        grown = np.interp(rows + np.asarray(more, dtype=np.float64), counts, seconds)
        return np.maximum(0.0, grown - np.interp(float(rows), counts, seconds))
