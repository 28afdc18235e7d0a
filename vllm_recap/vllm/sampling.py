"""Which requests may verify a tree: greedy ones whose sampler does nothing per position.

vLLM's rejection sampler treats the draft list as a chain: penalties, bad words, min_tokens,
allowed ids and logprobs are computed per chain position. For a tree those positions are not
one sequence, so such requests (and every sampled request) get a single-path draft verified by
vLLM's own rejection sampler, which is correct for them.
"""
from __future__ import annotations

_EPS = 1e-5


def is_plain_greedy(params) -> bool:
    """True for greedy requests with no per-position sampling features."""
    if params is None:
        return False
    return (
        params.temperature < _EPS
        and params.logprobs is None
        and params.prompt_logprobs is None
        and abs(params.presence_penalty) < _EPS
        and abs(params.frequency_penalty) < _EPS
        and abs(params.repetition_penalty - 1.0) < _EPS
        and not params.bad_words
        and not params.allowed_token_ids
        and not params.logit_bias
        and params.min_tokens == 0
        and getattr(params, "structured_outputs", None) is None
    )
