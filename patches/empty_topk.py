"""Seam: vLLM's top-k-only filter must accept an empty batch of rows.

With speculative decoding, vLLM builds spec-decode metadata for a step even when no request
has drafts (a prefill step), and its rejection sampler then filters a [0, V] block of target
logits. On CPU (no Triton) that reaches ``apply_top_k_only``, whose ``k.max()`` raises on an
empty tensor: the first request that asks for ``top_k`` without ``top_p`` takes the engine
down (vLLM 0.32, any speculative method). Zero rows need no filtering, so the wrapper returns
them unchanged and calls vLLM's function otherwise. Installed by the RECAP proposer.
"""
from __future__ import annotations

from vllm_recap.patches import wrap

SEAM = "topk_topp_sampler.apply_top_k_only (empty batch)"


def install() -> None:
    from vllm.v1.sample.ops import topk_topp_sampler

    def make(original):
        def apply_top_k_only(logits, k):
            if logits.shape[0] == 0:
                return logits
            return original(logits, k)

        return apply_top_k_only

    wrap(topk_topp_sampler, "apply_top_k_only", SEAM, ["logits", "k"], make)
