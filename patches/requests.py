"""Seams on the request path.

- ``SamplingParams._validate_spec_decode`` (front end): a structured-output request sent to a
  RECAP engine is refused with a clear error (drafts are trees; vLLM's grammar checks chains).
- ``NewRequestData.from_request`` (engine core): carries the request's ``cache_salt`` to the
  worker, where RECAP partitions its persistent memory by it (the same isolation key vLLM's
  prefix cache uses).
"""
from __future__ import annotations

from vllm_recap.patches import target, wrap

VALIDATE = "SamplingParams._validate_spec_decode"
SALT = "NewRequestData.from_request"


def is_recap(speculative_config) -> bool:
    from vllm_recap.vllm import PROPOSER_PATH

    return (speculative_config is not None
            and getattr(speculative_config, "method", None) == "custom_class"
            and getattr(speculative_config, "model", None) == PROPOSER_PATH)


def install() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData

    def make_validate(original):
        def _validate_spec_decode(self, speculative_config):
            original(self, speculative_config)
            if is_recap(speculative_config) and getattr(self, "structured_outputs", None) is not None:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(
                    "Structured outputs (JSON schema, regex, grammar, choice) are not supported "
                    "with speculative method 'recap'. Send this request to an engine without "
                    "speculative decoding, or drop structured_outputs from the request.",
                    parameter="structured_outputs",
                )

        return _validate_spec_decode

    wrap(SamplingParams, "_validate_spec_decode", VALIDATE, ["self", "speculative_config"],
         make_validate)

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
