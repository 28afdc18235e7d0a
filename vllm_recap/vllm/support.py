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


def emulated_bf16_reason(dtype: Any, on_cpu: bool, native_bf16: bool) -> str | None:
    """Why speculation will not pay on this engine's dtype (None: nothing to say).

    vLLM's ``dtype auto`` loads a bfloat16 checkpoint in bfloat16 on any x86 CPU. Without
    AVX512_BF16 the bf16 matmuls run emulated and cost about linearly in a pass's tokens, so
    verifying drafts costs what the accepted tokens save, and plain decoding is slower than in
    float32 too: on a 2-core AMD EPYC with AVX2 only, SmolLM2-135M decoded 13-14 tokens/s in
    bf16 against 21-23 in float32, and every speculative method (RECAP tree and single path,
    vLLM suffix decoding) ran 0.96-1.01x of plain decoding in bf16 against 1.07-1.14x in
    float32 (26 Spec-Bench prompts x 64, batch 1; ``benchmarks/results/avx2-dtype_2026-12-07``).
    A warning, not a refusal: the output is still exact, and the choice is the user's.
    """
    import torch

    if on_cpu and dtype == torch.bfloat16 and not native_bf16:
        return ("the model runs in bfloat16 on a CPU without AVX512_BF16, where bf16 matmuls "
                "are emulated: a pass costs about linearly in its tokens, so verified drafts "
                "save little, and plain decoding is slower than in float32 as well. Start "
                "vLLM with --dtype float32 (LLM(..., dtype='float32')) on this CPU")
    return None


def cpu_has_native_bf16() -> bool:
    """False only on an x86 CPU without AVX512_BF16 (other architectures: not judged here)."""
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)())
