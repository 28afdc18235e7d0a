"""Seams on the request path.

- ``NewRequestData.from_request`` (engine core): carries the request's ``cache_salt`` to the
  worker, where RECAP partitions its persistent memory by it (the same isolation key vLLM's
  prefix cache uses).

Structured-output requests (JSON schema, regex, grammar, choice) need no seam: they are never
tree-eligible (:mod:`vllm_recap.vllm.eligibility`), so RECAP sends them a single path, and
vLLM's own structured-output machinery does for it what it does for n-gram drafts -- the
scheduler cuts the drafts at the first token the grammar rejects, and the grammar's mask is
applied to every draft position's logits before verification.
"""
from __future__ import annotations

from vllm_recap.patches import target

SALT = "NewRequestData.from_request"


def is_recap(speculative_config) -> bool:
    from vllm_recap.vllm import PROPOSER_PATH

    return (speculative_config is not None
            and getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) == PROPOSER_PATH)


def install() -> None:
    from vllm.v1.core.sched.output import NewRequestData

    target_fn = NewRequestData.from_request  # bound classmethod: wrap its function
    if getattr(target_fn, "__recap_seam__", None) != SALT:
        target(NewRequestData, "from_request", SALT, ["request", "block_ids"])
        original = target_fn.__func__

        def from_request(cls, *args, **kwargs):
            data = original(cls, *args, **kwargs)
            request = kwargs.get("request", args[0] if args else None)
            data.recap_cache_salt = getattr(request, "cache_salt", None)
            return data

        from_request.__recap_seam__ = SALT
        NewRequestData.from_request = classmethod(from_request)
