"""What the CPU and CUDA tree-aware attention implementations share.

Each is a subclass of vLLM's own implementation that runs the stock kernel for the whole
batch (exact for prefill, plain decode and chains) and then fixes the rows of requests that
verify a tree. Both make the same decision -- is there a tree step to fix in this layer? --
from the step context the driver installed; the driver hands its scope to every layer at
model load (``bind_step_scope``), so no module-level state connects them.
"""
from __future__ import annotations

from vllm.v1.attention.backend import AttentionType

from vllm_recap.vllm.context import StepContext, StepScope

CHAIN_HINT = "use speculative_config {'method': 'recap', 'draft_mode': 'chain'}"


class TreeAttentionMixin:
    """Mixed into a vLLM ``AttentionImpl`` subclass (before the vLLM class in the bases)."""

    _recap_scope: StepScope | None = None

    def tree_unsupported_reason(self) -> str | None:
        """Why this layer cannot verify trees (checked at model load; None: it can)."""
        return None

    def bind_step_scope(self, scope: StepScope) -> None:
        """Called once per layer by the proposer when vLLM hands it the loaded model."""
        self._recap_scope = scope

    def tree_step(self, attn_metadata) -> StepContext | None:
        """The step context when this layer must fix tree rows in this forward, else None
        (no RECAP step running, no tree this step, a profiling run, a non-decoder layer)."""
        scope = self._recap_scope
        ctx = scope.current if scope is not None else None
        if ctx is None or not ctx.plan.trees or attn_metadata is None \
                or self.attn_type != AttentionType.DECODER:
            return None
        return ctx
