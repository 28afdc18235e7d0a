"""Seams on vLLM's V1 model runner (``GPUModelRunner``, which the CPU runner inherits).

vLLM calls a custom-class proposer with sampled token ids only. RECAP needs, per step, the
request ids, the logits of every evaluated position, control over tree positions and over the
acceptance of tree drafts. These methods are wrapped; each wrapper hands over to the runner's
:class:`~vllm_recap.vllm.hooks.RecapHooks` when its drafter has them, and otherwise calls
vLLM's method unchanged:

    execute_model             step boundary: end_step if it raises
    _update_states            -> hooks.on_update_states (finished / preempted requests)
    _prepare_inputs           -> hooks.begin_step (tree layout, positions)
    _sample                   -> hooks.sample (rows, tree acceptance, KV compaction)
    _input_fits_in_drafter    -> hooks.input_fits (RECAP sizes drafts per request)
    propose_draft_token_ids   -> hooks.propose (observe, commit, propose)
    sample_tokens             step boundary: end_step, always
"""
from __future__ import annotations

from collections.abc import Iterable

from vllm_recap.patches import fail, wrap
from vllm_recap.vllm.hooks import hooks_of

def _seam(name: str) -> str:
    return f"GPUModelRunner.{name}"


def _execute_model(original):
    def execute_model(self, scheduler_output, *args, **kwargs):
        try:
            return original(self, scheduler_output, *args, **kwargs)
        except BaseException:
            hooks = hooks_of(self)
            if hooks is not None:
                hooks.end_step()
            raise
    return execute_model


def _sample_tokens(original):
    def sample_tokens(self, grammar_output, *args, **kwargs):
        try:
            return original(self, grammar_output, *args, **kwargs)
        finally:
            hooks = hooks_of(self)
            if hooks is not None:
                hooks.end_step()
    return sample_tokens


def _update_states(original):
    def _update_states(self, scheduler_output):
        hooks = hooks_of(self)
        if hooks is not None:
            hooks.check_runner(self)
            hooks.on_update_states(self, scheduler_output)
        return original(self, scheduler_output)
    return _update_states


def _prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original(self, scheduler_output, num_scheduled_tokens)
        hooks = hooks_of(self)
        if hooks is not None:
            hooks.begin_step(self, scheduler_output)
        return result
    return _prepare_inputs


def _sample(original):
    def _sample(self, logits, spec_decode_metadata):
        hooks = hooks_of(self)
        if hooks is None:
            return original(self, logits, spec_decode_metadata)
        return hooks.sample(self, lambda lg, md: original(self, lg, md), logits,
                            spec_decode_metadata)
    return _sample


def _input_fits_in_drafter(original):
    def _input_fits_in_drafter(self, common_attn_metadata):
        hooks = hooks_of(self)
        if hooks is None:
            return original(self, common_attn_metadata)
        return hooks.input_fits(self, common_attn_metadata)
    return _input_fits_in_drafter


def _propose_draft_token_ids(original):
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, *args, **kwargs):
        hooks = hooks_of(self)
        if hooks is None:
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                            hidden_states, *args, **kwargs)
        return hooks.propose(self, scheduler_output, sampled_token_ids, hidden_states)
    return propose_draft_token_ids


# method -> (the leading parameters the wrapper relies on, the wrapper factory)
WRAPPED = {
    "execute_model": (["self", "scheduler_output"], _execute_model),
    "_update_states": (["self", "scheduler_output"], _update_states),
    "_prepare_inputs": (["self", "scheduler_output", "num_scheduled_tokens"], _prepare_inputs),
    "_sample": (["self", "logits", "spec_decode_metadata"], _sample),
    "_input_fits_in_drafter": (["self", "common_attn_metadata"], _input_fits_in_drafter),
    "propose_draft_token_ids": (["self", "scheduler_output", "sampled_token_ids",
                                 "sampling_metadata", "hidden_states"], _propose_draft_token_ids),
    "sample_tokens": (["self", "grammar_output"], _sample_tokens),
}


def install() -> None:
    """Wraps the runner methods (idempotent)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name, (params, factory) in WRAPPED.items():
        wrap(GPUModelRunner, name, _seam(name), params, factory)


def verify_runner(runner, attributes: Iterable[str]) -> None:
    """Checks that ``runner`` goes through every seam and has what the adapter reads.

    A runner class that overrides a wrapped method would bypass the seam and silently stop
    RECAP from drafting (or verify trees as chains): refuse it, naming the class and method.

    Args:
        runner: vLLM's model runner.
        attributes: dotted attribute paths the adapter reads (e.g. "input_batch.req_ids").

    Raises:
        SeamError: a bypassed seam or a missing attribute.
    """
    cls = type(runner)
    for name in WRAPPED:
        fn = getattr(cls, name, None)
        if getattr(fn, "__recap_seam__", None) != _seam(name):
            owner = next((c for c in cls.__mro__ if name in vars(c)), cls)
            raise fail(_seam(name), f"{owner.__module__}.{owner.__qualname__} overrides "
                                    f"{name}, so speculative method 'recap' cannot run on "
                                    f"{cls.__qualname__}")
    for path in attributes:
        obj = runner
        for part in path.split("."):
            if not hasattr(obj, part):
                raise fail("model runner attributes", f"{cls.__qualname__} has no {path}")
            obj = getattr(obj, part)
