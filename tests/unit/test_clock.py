"""The step clock: what the budget learns a step cost, and which steps it skips."""
from __future__ import annotations

import time

import numpy as np
import pytest

from vllm_recap.vllm.clock import StepClock
from vllm_recap.vllm.context import StepTiming

pytestmark = pytest.mark.unit


def _run_step(clock: StepClock, timing: StepTiming, tokens: int = 1, pause: float = 0.002,
              tree: bool = False, drafts: int = 0):
    previous = clock.step_started(tokens, 100.0, drafts, tree=tree)
    time.sleep(pause)
    clock.step_finished(timing)
    return previous


def test_seeding_is_taken_out_and_shared_lm_head_steps_are_skipped():
    clock = StepClock()
    assert _run_step(clock, StepTiming(work=0.001, seeding=0.0005)) is None  # first step
    tokens, seconds, context, drafts, work, tree = _run_step(clock, StepTiming(), tree=True)
    assert tokens == 1 and context == 100.0 and drafts == 0 and not tree
    assert seconds > 0.0 and work == pytest.approx(0.0005)  # seeding left out of the work
    # prompt rows rode along with this step's LM-head call: its cost is not a clean sample
    assert _run_step(clock, StepTiming(shared_lm_head=True)) is not None
    assert _run_step(clock, StepTiming()) is None
    assert _run_step(clock, StepTiming()) is not None  # and the next one is again


def test_each_steps_seeding_is_kept_next_to_its_work():
    """The benchmarks tell the slow steps that computed prompt rows from the others."""
    clock = StepClock()
    for timing in (StepTiming(work=0.001), StepTiming(work=0.009, seeding=0.008),
                   StepTiming(work=0.002)):
        _run_step(clock, timing, pause=0.0)
    assert list(clock.work_seconds) == [0.001, 0.009, 0.002]
    assert list(clock.seeding_seconds) == [0.0, 0.008, 0.0]


def test_a_step_reports_whether_it_verified_a_tree():
    """The budget prices tree steps and chain steps from separate tables."""
    clock = StepClock()
    for _ in range(2):  # each drafted shape's first step is not reported (see below)
        _run_step(clock, StepTiming(), tokens=5, drafts=4, tree=True)
    assert _run_step(clock, StepTiming(), tokens=5)[-1] is True
    assert _run_step(clock, StepTiming())[-1] is False


def test_the_first_drafted_step_of_each_shape_is_not_reported():
    """A new shape's first drafted pass pays one-time costs (kernels set up per row count,
    buffers allocated): the first drafted step of a fresh engine ran >= 3x its estimate and
    set the budget's tree cost ratio to 1.5 for a whole run, which then idled in 680-777 of
    ~870 steps (benchmarks.proposer_profile --sampling qwen_vl; 64-469 with this rule)."""
    clock = StepClock()
    _run_step(clock, StepTiming(), tokens=9)
    assert _run_step(clock, StepTiming(), tokens=9, drafts=8, tree=True)[0] == 9  # plain: kept
    assert _run_step(clock, StepTiming(), tokens=9, drafts=8) is None  # first 9-token tree
    assert _run_step(clock, StepTiming(), tokens=9, drafts=8, tree=True) is None  # 1st chain
    assert _run_step(clock, StepTiming(), tokens=1)[-1] is True  # a second 9-token tree step
    assert _run_step(clock, StepTiming(), tokens=1)[0] == 1


def test_lm_head_times_estimate_a_call_from_the_row_counts_measured_around_it():
    """What a step's own rows alone would have cost its LM-head call (the rest of a call that
    carried prompt rows is the rows' share): interpolated between measured row counts, the
    largest one below beyond them, unknown below the smallest."""
    from vllm_recap.vllm.clock import LmHeadTimes

    times = LmHeadTimes(decay=0.5)
    assert times.estimate(8) is None  # nothing measured: the share cannot be told
    times.observe(4, 0.010)
    assert times.estimate(3) is None and times.estimate(9) == pytest.approx(0.010)
    times.observe(12, 0.030)
    assert times.estimate(4) == pytest.approx(0.010)
    assert times.estimate(8) == pytest.approx(0.020)
    assert times.estimate(64) == pytest.approx(0.030)
    times.observe(4, 0.020)  # a moving mean per row count
    assert times.estimate(4) == pytest.approx(0.015)


def test_lm_head_times_price_more_rows_by_the_measured_staircase():
    """What r more rows add to a step's LM-head call (the prompt seeder's price): the
    difference of the measured curve at the step's rows + r and at its rows, interpolated,
    flat beyond the measured counts, never negative (SmolLM2's 1-row call is dearer than its
    2-row one)."""
    from vllm_recap.vllm.clock import LmHeadTimes

    times = LmHeadTimes()
    assert times.growth(4, np.arange(3)) is None  # nothing measured
    for rows, seconds in [(1, 0.0020), (2, 0.0013), (11, 0.0014), (17, 0.0030)]:
        times.observe(rows, seconds)
    more = np.array([0, 1, 10, 13, 16, 40])
    assert times.growth(1, more) == pytest.approx([0, 0, 0, 0.0002, 0.0010, 0.0010])
    assert times.growth(11, np.array([0, 3, 6, 20])) == pytest.approx(
        [0, 0.0008, 0.0016, 0.0016])
    assert times.growth(40, np.array([0, 10])) == pytest.approx([0, 0])  # beyond: flat
