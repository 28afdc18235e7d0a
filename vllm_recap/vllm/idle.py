"""Idle mode: when the step driver skips RECAP's per-request work, and when it probes back.

Under load the budget declines most drafts (a pass of many requests' drafts costs more than
it saves), and then the per-request work of a step -- top-K rows, memory updates, proposals --
is pure overhead: ~4 ms a step at concurrency 16 (AVX2, float32) when nothing was drafted.
:class:`IdleMode` watches the steps' drafts and decides, step by step, whether the next step
does that work. An idle step still commits its tokens, and the driver offers the continuations
of recurring text there (``WATCH_MATCH``), which need no rows.

Every input is the same on every tensor-parallel rank: the proposals are the full trees every
rank builds, and drafts count as scheduled (rank 0's choice).
"""
from __future__ import annotations

import logging
from typing import Mapping

from vllm_recap.core.tree import DraftTree
from vllm_recap.vllm.context import StepPlan
from vllm_recap.vllm.drain import DrainWatch

# DEBUG: every switch of the idle mode (``VLLM_LOGGING_LEVEL=DEBUG``; the driver's logger)
logger = logging.getLogger("vllm.recap")

# Steps without drafts before idling, the probe period (it doubles after every probe that did
# not resume drafting, up to the longest, and starts over when a request arrives) and its
# length.
IDLE_AFTER = 4
PROBE_EVERY = 16
PROBE_EVERY_LONGEST = 128
PROBE_WINDOW = 2
# ... and only while the share of recent steps that drafted, of those offered drafts (a moving
# average with this weight per step), is below IDLE_BELOW_DRAFTING: a batch that drafts in
# most steps has runs of declines too, and idling through them lost its next drafts.
DRAFTING_WEIGHT = 1 / 16
IDLE_BELOW_DRAFTING = 0.25
# An idle step still commits its tokens, and a request whose last WATCH_MATCH tokens occurred
# before (in its history or the shared index) gets its continuation proposed there -- no rows
# needed, a few microseconds a request -- for the budget to take or decline. Idling otherwise
# passed over the text a request copies: on greedy SmolLM2 Spec-Bench outputs a quarter of the
# positions follow a match of 3+ tokens, whose continuation's next token held 69-93% of the
# time (2.7-4.8 of 8 tokens), while RECAP idled through ~half of its steps at concurrency 4.
# Plain greedy requests only: under Qwen2.5-VL's settings (repetition penalty 1.05, which
# works against copies) the watch first ran 1.17x of plain decoding at concurrency 4 against
# 1.30x without it (2 rounds, AVX2 EPYC, float32), a gap later traced to the engines' order in
# the round; with the order alternating, watching penalised requests too ran 1.22x against
# 1.19x (4 rounds, not shown either way), so the restriction stays. 0 turns the watch off.
WATCH_MATCH = 3


class IdleMode:
    """Decides per step whether the driver idles (see :meth:`step`).

    Args:
        adaptive: the budget decides the drafts (a fixed budget never idles: its drafts are
            the user's choice).
        drain: the batch's drain watch, updated here once per step (the driver reads it).
    """

    def __init__(self, adaptive: bool, drain: DrainWatch) -> None:
        self.adaptive = adaptive
        self.drain = drain
        self.quiet = 0  # consecutive steps whose offered drafts were all declined
        self.drafting = 0.0  # moving share of drafted steps among those offered drafts
        self.probe_every = PROBE_EVERY  # idle steps between probes
        self.since_probe = 0  # idle or probing steps since the last probe window began
        self._running: set[str] = set()  # the previous step's requests (to see arrivals)
        self.idle = False  # the last step's decision

    def step(self, plan: StepPlan, proposals: Mapping[str, DraftTree]) -> bool:
        """Skip RECAP's per-request work this step (rows, memory updates, proposals)?

        ``plan`` is the step's layout (its requests and the drafts scheduled for them),
        ``proposals`` the trees the drafter offered for this step, by request id.

        When the budget keeps declining the drafts the drafter offers (drafting does not pay
        for this batch, e.g. under load), that work is pure overhead. After ``IDLE_AFTER``
        steps whose offered drafts were all declined the driver idles, except for probe
        windows of ``PROBE_WINDOW`` steps, which do the full work (their rows refresh the
        memories, so the probe's trees are real) and let the budget decide to draft again.
        Probes come every ``PROBE_EVERY`` steps, and the period doubles after each probe that
        did not resume drafting, up to ``PROBE_EVERY_LONGEST`` (at concurrency 8, probing 2
        steps in 16 plus the steps before idling again cost more than drafting won); it starts
        over at ``PROBE_EVERY`` when a request arrives.

        A run of declines idles only a batch that has mostly not been drafting: while the
        moving share of drafted steps (among steps offered drafts) is at least
        ``IDLE_BELOW_DRAFTING``, declines are the gaps between drafted stretches, not load.
        At concurrency 4 on an Intel Xeon (bf16 SmolLM2, 26 prompts x 64 tokens) the driver
        idled 62-103 steps a run through such gaps, the last request of the run alone
        included; with the share it idled 11-15 and ran +0.03 of plain decoding's speed on
        average over 7 paired rounds in two runs (1.24x against 1.18x, then 1.16x against
        1.16x), +0.04 at concurrency 8; at 16, where drafting never pays, the share stays
        near 0 and the driver idles as before (0.96-0.97x against 0.95-1.00x).
        """
        running = set(plan.req_ids)
        arrived = not running <= self._running
        if arrived and running.isdisjoint(self._running):
            # A batch none of whose requests ran before (at batch 1: every request) starts
            # with no history: the declines were of requests that are gone. Inheriting their
            # idle mode prefilled a new request idle -- its prompt never seeded, its first
            # drafts a probe period away (3 of 9 requests sampled at batch 1, Spec-Bench,
            # bf16 SmolLM2, Intel Xeon, while the test suite loaded the host; on a quiet
            # host no step of 26 such requests idled, before or after).
            self.quiet, self.drafting, self.since_probe = 0, 0.0, 0
        if self.drain.update(running, arrived) or arrived:
            # A new request may draft well where the others did not, and in a draining batch
            # the longest request may now be one that drafts well: probe at the base period
            # (a period grown by one long request's poor drafts cost the next request at batch
            # 1 under Qwen2.5-VL's settings: 1.11x of plain decoding before the back-off, 0.98x
            # with it).
            self.probe_every = PROBE_EVERY
            self.since_probe = min(self.since_probe, PROBE_EVERY)
        self._running = running
        if plan.num_drafts.any():
            self.quiet, self.since_probe, self.probe_every = 0, 0, PROBE_EVERY
            self.drafting += DRAFTING_WEIGHT * (1.0 - self.drafting)
        elif any(tree.num_nodes > 1 for tree in proposals.values()):
            self.quiet += 1  # drafts were offered and the budget declined them
            self.drafting -= DRAFTING_WEIGHT * self.drafting
        # A step where the drafter had nothing to offer (cold memories) leaves both as they
        # are: idling then would stop the memories from ever filling.
        idle = self._decide()
        if idle != self.idle and logger.isEnabledFor(logging.DEBUG):
            logger.debug("RECAP idle mode %s (%s)", "on" if idle else "off: probing or drafting",
                         self.describe())
        self.idle = idle
        return idle

    def _decide(self) -> bool:
        """Idle, from the state :meth:`step` brought up to date (probe windows counted)."""
        if not (self.adaptive and self.quiet > IDLE_AFTER
                and self.drafting < IDLE_BELOW_DRAFTING):
            return False
        self.since_probe += 1
        if self.since_probe <= self.probe_every:
            return True
        if self.since_probe > self.probe_every + PROBE_WINDOW:  # a probe that found nothing
            self.since_probe = 1
            self.probe_every = min(2 * self.probe_every, PROBE_EVERY_LONGEST)
            return True
        return False  # probing

    def describe(self) -> str:
        """The state behind a switch, for the driver's DEBUG log."""
        return (f"{self.quiet} declined steps in a row, drafted share {self.drafting:.2f}, "
                f"probe period {self.probe_every}")
