"""Which requests may verify a tree, and which are surely finished after a step.

Tree verification replaces vLLM's per-position sampling for the request, so a request may
verify a tree only when every one of its sampling settings is one the tree path reproduces
exactly. This is an allow-list over vLLM's ``SamplingParams``: a field the code does not know
(a newer vLLM's feature) makes the request *not* tree-eligible, and it gets a single-path
draft verified by vLLM's own rejection sampler, which is correct for anything vLLM supports.
"""
from __future__ import annotations

from typing import Any

_EPS = 1e-5  # vLLM's _SAMPLING_EPS: below it a temperature means greedy

# Fields that never change which token is chosen at a position: output formatting, stop
# rules (applied by the scheduler / detokenizer to the committed tokens, after acceptance),
# length limits, and the seed (greedy requests draw nothing).
NEUTRAL_FIELDS = frozenset({
    "n", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "detokenize",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "stream_interval", "skip_clone", "output_text_buffer_length",
    "_eos_token_id", "_all_stop_token_ids", "skip_reading_prefix_cache", "flat_logprobs",
    "prompt_logprob_start", "routed_experts_prompt_start",
    # Only read on the random path, which a greedy request never takes.
    "top_p", "top_k", "min_p", "_watermarking_skipped",
})


def _greedy(params: Any) -> bool:
    return params.temperature < _EPS


# Fields the tree path reproduces for some values: field -> (is the value supported, reason).
_CONDITIONAL = {
    "temperature": (_greedy, "temperature > 0 (sampled request)"),
}


def tree_unsupported_reason(params: Any) -> str | None:
    """Why this request cannot verify a tree (None: it can).

    Every field of ``params`` must be neutral, supported at its value, or at its default.
    """
    if params is None:
        return "no sampling parameters"
    fields = getattr(type(params), "__struct_fields__", None)
    if fields is None:
        return f"unknown parameter type {type(params).__name__}"
    defaults = _defaults(type(params))
    for name in fields:
        if name in NEUTRAL_FIELDS:
            continue
        check = _CONDITIONAL.get(name)
        if check is not None:
            if not check[0](params):
                return check[1]
            continue
        value = getattr(params, name)
        if not _is_default(value, defaults.get(name)):
            return f"{name.lstrip('_')} is set"
    return None


def _defaults(cls) -> dict[str, Any]:
    cached = getattr(cls, "__recap_defaults__", None)
    if cached is None:
        default = cls()
        cached = {f: getattr(default, f) for f in cls.__struct_fields__}
        cls.__recap_defaults__ = cached
    return cached


def _is_default(value: Any, default: Any) -> bool:
    # An empty list / dict / set, or False, is the same as None for every optional field the
    # engine fills in (bad_words=[], logit_bias={}, watermarking=False).
    if value is None or value is False or (hasattr(value, "__len__") and len(value) == 0):
        return default is None or default is False or (
            hasattr(default, "__len__") and len(default) == 0)
    return value == default


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
