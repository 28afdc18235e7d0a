"""Which engines can verify trees exactly, decided once at start (else: chains, one log line).

Tree verification changes what a step's tokens attend to and keeps rejected branches' K/V
out of the sequence. That is exact for decoder attention over a paged KV cache, and nothing
else: a recurrent layer (Mamba, linear attention) would fold every branch into one state, MLA
and encoder-decoder attention have no tree-aware backend here, and on CUDA the tree rows run
on FlashAttention, which has its own dtype / GPU / head-size limits. Such engines still get
RECAP's drafts, as single paths verified by vLLM's own rejection sampler -- never output that
differs from plain decoding, never a refused engine start.
"""
from __future__ import annotations

from typing import Any

from vllm_recap.vllm.cuda_recompute import _SUPPORTED_CACHE_DTYPES


def model_reason(model_config: Any) -> str | None:
    """Why this model cannot verify trees (None: it can)."""
    if getattr(model_config, "is_encoder_decoder", False):
        return "encoder-decoder models have no tree-aware cross attention"
    if getattr(model_config, "is_attention_free", False) or \
            getattr(model_config, "is_hybrid", False) or \
            getattr(model_config, "has_inner_state", False):
        return ("the model has recurrent layers (Mamba / linear attention), whose state would "
                "mix the tree's branches")
    if getattr(model_config, "use_mla", False):
        return "MLA attention has no tree-aware backend"
    return None


def flash_attention_reason(vllm_config: Any) -> str | None:
    """Why the CUDA tree path (FlashAttention) cannot serve this engine (None: it can).

    Checked before the backend is pinned: vLLM would otherwise refuse to start the engine.
    """
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as FA

    mc = vllm_config.model_config
    if not FA.supports_dtype(mc.dtype):
        return f"FlashAttention does not run {mc.dtype} models (use float16 or bfloat16)"
    if not FA.supports_head_size(mc.get_head_size()):
        return f"FlashAttention does not support head size {mc.get_head_size()}"
    capability = current_platform.get_device_capability()
    if capability is not None and not FA.supports_compute_capability(capability):
        return f"FlashAttention does not run on compute capability {capability.as_version_str()}"
    if getattr(mc, "is_mm_prefix_lm", False) and not FA.supports_mm_prefix():
        return "FlashAttention lacks the bidirectional image-token attention this model needs"
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if cache_dtype not in _SUPPORTED_CACHE_DTYPES:
        return f"the tree path does not read a {cache_dtype} KV cache"
    return None


def engine_reason(vllm_config: Any, platform: str) -> str | None:
    """Why trees cannot be verified on this engine (None: they can), for ``platform`` "cpu"
    or "cuda"."""
    reason = model_reason(vllm_config.model_config)
    if reason is None and platform == "cuda":
        reason = flash_attention_reason(vllm_config)
    if reason is None and platform not in ("cpu", "cuda"):
        reason = f"tree verification supports CPU and CUDA, not {platform}"
    if reason is None and platform == "cpu":
        cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
        if cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            reason = f"the CPU tree path does not read a {cache_dtype} KV cache"
    return reason
