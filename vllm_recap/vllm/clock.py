"""Step timing: what an engine step cost (for the node budget) and what RECAP's part was.

The budget controller learns the cost of a step as a function of the tokens it ran. The
runner seams see the start of each step (``begin_step``); a step's duration is the time to
the next step's start, unless the engine sat idle in between (then it is unknown and
skipped). Prompt seeding runs in some steps only and does not depend on the draft count, so
its time is taken out: otherwise the size measured in a seeding step looks dear for long. A
step whose prompt rows rode along with its own LM-head call is skipped too (their share of
that call cannot be timed apart).
"""
from __future__ import annotations

import time
from collections import deque

from vllm_recap.vllm.context import StepTiming

# A gap longer than this between one step's end and the next one's start is idle time.
IDLE_GAP_S = 0.25


class StepClock:
    """Measures engine steps and RECAP's own work per step.

    Attributes:
        work_seconds: RECAP's work per engine step (layout, rows, acceptance, memory updates,
            drafting), the last 4096 steps, for the benchmarks' p50/p99 proposer cost.
    """

    def __init__(self, history: int = 4096) -> None:
        self.work_seconds: deque[float] = deque(maxlen=history)
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
