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


def surely_finished(params, sampled: list[int], num_output_tokens: int, num_tokens: int,
                    max_model_len: int) -> bool:
    """True when the scheduler will finish the request after this step's tokens.

    Mirrors the scheduler's own stop rules that the worker can see (length, EOS, stop token
    ids), so request-local memory is freed at once instead of at the next engine step, which
    may never come when the engine goes idle. Stop *strings* are decided by the detokenizer;
    those requests are freed when the scheduler reports them finished.
    """
    if params is None:
        return False
    if num_tokens >= max_model_len or (params.max_tokens is not None
                                       and num_output_tokens >= params.max_tokens):
        return True
    stops = set(params.stop_token_ids or ())
    if getattr(params, "eos_token_id", None) is not None:
        stops.add(params.eos_token_id)
    return any(t in stops for t in sampled)
