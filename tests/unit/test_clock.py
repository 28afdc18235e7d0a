"""The step clock: what the budget learns a step cost, and which steps it skips."""
from __future__ import annotations

import time

import pytest

from vllm_recap.vllm.clock import StepClock
from vllm_recap.vllm.context import StepTiming

pytestmark = pytest.mark.unit


def _run_step(clock: StepClock, timing: StepTiming, tokens: int = 1, pause: float = 0.002,
              tree: bool = False):
    previous = clock.step_started(tokens, 100.0, tree=tree)
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


def test_a_step_reports_whether_it_verified_a_tree():
    """The budget prices tree steps and chain steps from separate tables."""
    clock = StepClock()
    _run_step(clock, StepTiming(), tokens=5, tree=True)
    assert _run_step(clock, StepTiming(), tokens=5)[-1] is True
    assert _run_step(clock, StepTiming())[-1] is False
