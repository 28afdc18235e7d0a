"""SamplingFacts: what the driver keeps per request from its real vLLM SamplingParams."""
from __future__ import annotations

import pytest
from vllm import SamplingParams

from vllm_recap.vllm.eligibility import SamplingFacts

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("kwargs, plain, kind", [
    (dict(temperature=0.0), True, "greedy"),
    (dict(temperature=0.7, top_k=1), True, "greedy"),  # top_k 1: the argmax decides
    (dict(temperature=0.1, top_k=1, top_p=0.001, repetition_penalty=1.05), False, "greedy"),
    (dict(temperature=0.0, presence_penalty=0.5), False, "greedy"),
    (dict(temperature=0.0, min_tokens=4, stop_token_ids=[2]), False, "greedy"),
    (dict(temperature=0.7, top_p=0.8, top_k=20), False, "sampled"),
])
def test_facts_of_real_params(kwargs, plain, kind):
    facts = SamplingFacts.of(SamplingParams(max_tokens=8, **kwargs))
    assert (facts.plain, facts.kind, facts.trees, facts.logprobs) == (plain, kind, True, False)


def test_logprobs_and_chain_only_fields():
    assert SamplingFacts.of(SamplingParams(temperature=0.0, logprobs=2)).logprobs
    assert not SamplingFacts.of(SamplingParams(temperature=0.0, prompt_logprobs=1)).trees
    assert not SamplingFacts.of(SamplingParams(temperature=0.0, extra_args={"x": 1})).trees
