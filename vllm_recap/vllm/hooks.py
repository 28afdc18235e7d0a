"""The interface the runner seams call (``vllm_recap.patches.runner``).

The seams know this Protocol only, never the proposer class, so ``patches`` and the adapter
do not import each other. A runner's drafter takes part when it exposes ``recap_hooks``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Protocol, runtime_checkable

import torch


@runtime_checkable
class RecapHooks(Protocol):
    """One engine step, in the order vLLM's V1 runner reaches the seams.

    ``execute_model``: ``on_update_states`` -> (vLLM prepares inputs) -> ``begin_step`` ->
    forward (attention backends read the step context) -> ``sample_tokens``: ``sample`` ->
    (bookkeeping) -> ``propose`` -> ``end_step``. ``end_step`` also runs when
    ``execute_model`` or ``sample_tokens`` raises.
    """

    def check_runner(self, runner: Any) -> None:
        """Raises if the runner lacks what the adapter reads or bypasses a seam."""

    def on_update_states(self, runner: Any, scheduler_output: Any) -> None:
        """Lifecycle: frees finished, aborted and preempted requests; records new ones."""

    def begin_step(self, runner: Any, scheduler_output: Any) -> None:
        """Lays out the step after vLLM prepared its inputs (tree positions, context)."""

    def sample(self, runner: Any, original: Callable[[torch.Tensor, Any], Any],
               logits: torch.Tensor, spec_decode_metadata: Any) -> Any:
        """Runs vLLM's sampler via ``original``, then tree acceptance; keeps the step's rows."""

    def input_fits(self, runner: Any, common_attn_metadata: Any) -> bool:
        """Whether the proposer runs this step (RECAP decides per request, not per batch)."""

    def propose(self, runner: Any, scheduler_output: Any,
                sampled_token_ids: list[list[int]], hidden_states: torch.Tensor
                ) -> list[list[int]]:
        """Observes the step's rows, commits its tokens, returns next drafts [B][*]."""

    def end_step(self) -> None:
        """Clears the step context (always runs, also after an exception)."""


def hooks_of(runner: Any) -> RecapHooks | None:
    """The RECAP hooks of a runner's drafter, or None for any other drafter."""
    hooks = getattr(getattr(runner, "drafter", None), "recap_hooks", None)
    return hooks if hooks is not None and _implements_hooks(type(hooks)) else None


@functools.cache
def _implements_hooks(cls: type) -> bool:
    """``isinstance(x, RecapHooks)`` decided once per class: the Protocol check looks up every
    method (~30 us), and the seams ask six times per engine step."""
    return all(callable(getattr(cls, name, None)) for name in _HOOK_METHODS)


_HOOK_METHODS = tuple(name for name in vars(RecapHooks)
                      if not name.startswith("_") and callable(vars(RecapHooks)[name]))
