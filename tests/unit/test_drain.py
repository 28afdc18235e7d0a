"""Draining batches: when the batch drains, and which requests the remaining run waits for."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from vllm_recap.vllm.drain import DrainWatch, longest_requests, remaining_tokens

pytestmark = pytest.mark.unit


def test_a_batch_drains_once_it_shrinks_until_a_request_arrives_into_a_full_batch():
    watch = DrainWatch()
    assert not watch.update({"a", "b", "c"}, arrived=True)  # the batch fills
    assert not watch.draining
    # a finished request replaced in the same step (the scheduler had one waiting)
    assert not watch.update({"a", "b", "d"}, arrived=True) and not watch.draining
    assert watch.update({"a", "b"}, arrived=False) and watch.draining  # nobody took its place
    assert not watch.update({"a", "b"}, arrived=False) and watch.draining
    # fewer new requests than finished ones: still draining (the last ones of a closed loop)
    assert watch.update({"e"}, arrived=True) and watch.draining
    assert not watch.update({"e", "f"}, arrived=True) and not watch.draining  # traffic again


def test_remaining_tokens_count_max_tokens_and_the_model_length():
    params = SimpleNamespace(max_tokens=64)
    assert remaining_tokens(params, num_tokens=110, num_prompt_tokens=100, max_model_len=512) == 54
    assert remaining_tokens(params, num_tokens=500, num_prompt_tokens=490, max_model_len=512) == 12
    assert remaining_tokens(None, num_tokens=500, num_prompt_tokens=490, max_model_len=512) == 12
    unbounded = SimpleNamespace(max_tokens=None)
    assert remaining_tokens(unbounded, 110, 100, 512) == 402


def test_the_run_waits_for_the_requests_with_the_most_tokens_left():
    remaining = [10, 40, 25, 40, 5]
    longest, drain = longest_requests([0, 1, 2, 3], remaining, prefilling=[])
    assert longest == [1, 3] and drain.slack == 15 and drain.decoding == 4
    # a request still in prefill counts as in flight: here it has the most left, so no
    # decoding request's drafts shorten the run
    longest, drain = longest_requests([0, 1, 2], remaining, prefilling=[3])
    assert longest == []
    longest, drain = longest_requests([1, 2], remaining, prefilling=[4])
    assert longest == [1] and drain.slack == 15
    longest, drain = longest_requests([1], remaining, prefilling=[])
    assert longest == [1] and math.isinf(drain.slack)
