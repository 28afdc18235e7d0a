"""Which requests may verify a tree, and which are surely finished after a step.

Tree verification replaces vLLM's per-position sampling for the request (the rows are
processed by :mod:`vllm_recap.vllm.tree_sampling`, walked by :mod:`vllm_recap.vllm.tree_walk`),
so a request may verify a tree only when every one of its sampling settings is one the tree
path reproduces exactly. This is an allow-list over vLLM's ``SamplingParams``: a field the
code does not know (a newer vLLM's feature) makes the request *not* tree-eligible, and it gets
a single-path draft verified by vLLM's own rejection sampler, which is correct for anything
vLLM supports.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

_EPS = 1e-5  # vLLM's _SAMPLING_EPS: below it a temperature means greedy

# Reproduced exactly per node by the code above, whatever their (valid) value. min_p and
# logit_bias are exact against vLLM without speculation; vLLM itself refuses them on a
# speculative engine (SamplingParams._validate_spec_decode), so they never arrive there.
_TREE_EXACT = frozenset({
    "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "min_tokens", "stop_token_ids", "_all_stop_token_ids",
    "_eos_token_id", "logit_bias", "allowed_token_ids", "bad_words", "_bad_words_token_ids",
    "logprobs",
})
# Act after sampling (scheduler stop checks, detokenizer, output formatting, caching): the same
# for a token however it was verified. n > 1 fans out into separate requests.
_AFTER_SAMPLING = frozenset({
    "n", "stop", "ignore_eos", "max_tokens", "flat_logprobs", "detokenize",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "stream_interval", "skip_clone", "output_text_buffer_length",
    "_watermarking_skipped", "skip_reading_prefix_cache", "repetition_detection",
    "routed_experts_prompt_start",
})
# Must keep vLLM's default; anything else (including fields this code has never seen) is
# named in the reason. watermarking=None means "engine default": the driver must also refuse
# trees when the engine has a watermark config (only vLLM's v2 GPU runner applies one).
_ALSO_ALLOWED = {"watermarking": (None, False)}


def tree_unsupported_reason(params) -> str | None:
    """None when every field of ``params`` has a value trees reproduce exactly, else a reason.

    Unsupported today: structured_outputs (vLLM's grammar validates and masks the drafts of
    a single path, position after position: a tree's siblings are no sequence it can check),
    logprob_token_ids, prompt_logprobs (and its prompt_logprob_* companions: not verified
    alongside tree rows), extra_args (custom samplers may read it), thinking_token_budget,
    trace_decode_token_ids, watermarking=True, and any field added by a later vLLM that is not
    at its default.
    """
    if params is None:
        return "no sampling params"
    defaults = _default_params(type(params))
    for name in type(params).__struct_fields__:
        if name in _TREE_EXACT or name in _AFTER_SAMPLING:
            continue
        value = getattr(params, name)
        if name in _ALSO_ALLOWED and value in _ALSO_ALLOWED[name]:
            continue
        if not hasattr(defaults, name) or not _same(value, getattr(defaults, name)):
            return f"{name} is not reproduced for trees"
    return None


def _same(a, b) -> bool:
    """Equality that never raises (array-valued fields compare as different); an empty list /
    dict or False equals None, as the engine fills optional fields in (extra_args={})."""
    a, b = _unset(a), _unset(b)
    if a is None or b is None:
        return a is b
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def _unset(value):
    if value is False or (isinstance(value, (list, tuple, dict, set, frozenset))
                          and len(value) == 0):
        return None
    return value


_DEFAULTS: dict[type, object] = {}


def _default_params(cls: type):
    """A default instance of the params' class (post-init normalised like every request's)."""
    if cls not in _DEFAULTS:
        _DEFAULTS[cls] = cls()
    return _DEFAULTS[cls]


@dataclass(frozen=True)
class SamplingFacts:
    """What the driver reads from a request's sampling params every step, worked out once per
    params object (a request keeps its params; re-reading them cost ~25 us a step at batch 1
    for the allow-list alone).

    Attributes:
        params: the params these facts are of (identity decides whether they still hold).
        trees: the request may verify a tree (:func:`tree_unsupported_reason` is None).
        plain: greedy-equivalent with nothing else to process: the raw rows' argmax decides
            a tree walk when no logprobs are kept (temperature and top-k/p do not move the
            argmax; :attr:`~vllm_recap.vllm.tree_sampling.RequestSampling.is_plain` at
            temperature 0).
        kind: the acceptance rule, for the budget's calibration: "greedy" when the argmax
            decides (:func:`greedy_equivalent`), else "sampled".
        logprobs: the request asks for sample logprobs (tree rows are then kept for them).
        seeded: a sampled request with a seed (its draws follow its seed stream:
            :mod:`~vllm_recap.vllm.seeded`).
    """

    params: Any
    trees: bool
    plain: bool
    kind: str
    logprobs: bool
    seeded: bool = False

    @classmethod
    def of(cls, params: Any) -> SamplingFacts:
        from vllm_recap.vllm.tree_sampling import RequestSampling

        state = None if params is None else RequestSampling.from_params(params, (), ())
        greedy = state is None or state.greedy_equivalent  # as greedy_equivalent(params)
        plain = greedy and (state is None or replace(state, temperature=0.0).is_plain)
        return cls(params, tree_unsupported_reason(params) is None, plain,
                   "greedy" if greedy else "sampled",
                   getattr(params, "logprobs", None) is not None,
                   not greedy and getattr(params, "seed", None) is not None)


def greedy_equivalent(params: Any) -> bool:
    """The argmax decides the token (temperature below vLLM's epsilon, or top_k == 1)."""
    return params is None or params.temperature < _EPS or params.top_k == 1


def surely_finished(params: Any, sampled: list[int], num_output_tokens: int, num_tokens: int,
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
    if num_output_tokens < params.min_tokens:
        return False
    stops = set(params.stop_token_ids or ())
    if not params.ignore_eos and getattr(params, "eos_token_id", None) is not None:
        stops.add(params.eos_token_id)
    return any(t in stops for t in sampled)
