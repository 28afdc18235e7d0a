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


def test_structured_output_requests_are_single_paths_in_their_own_memory_partition():
    """A grammar-bound request verifies single paths (vLLM's grammar checks chains only) and
    learns into its own partition of its cache salt, so free-text requests of that salt never
    draft from rows taken under a grammar mask; a salt string cannot name that partition."""
    from types import SimpleNamespace

    from vllm.sampling_params import StructuredOutputsParams

    from vllm_recap.core.config import RecapConfig
    from vllm_recap.core.drafter import Drafter
    from vllm_recap.vllm.records import GrammarPartition, RequestBook, partition_key

    grammar = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    plain = SamplingParams(temperature=0.0)
    assert not SamplingFacts.of(grammar).trees
    assert partition_key("tenant", grammar) == GrammarPartition("tenant") != "tenant"
    assert partition_key(None, grammar) == GrammarPartition(None) != partition_key(None, plain)
    assert partition_key("tenant", plain) == "tenant" and partition_key(None, None) is None
    book = RequestBook(Drafter(RecapConfig(), vocab_size=64))
    book.apply(SimpleNamespace(
        finished_req_ids=(), preempted_req_ids=(), scheduled_cached_reqs=SimpleNamespace(),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, recap_cache_salt="t", sampling_params=p)
                            for r, p in (("g", grammar), ("f", plain))]))
    assert book.get("g").salt == GrammarPartition("t") and book.get("f").salt == "t"
