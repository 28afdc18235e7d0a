"""Seam: vLLM's attention-backend registry points the platform's backend at a tree-aware one.

vLLM's CPU platform always selects ``CPU_ATTN`` (it ignores ``attention_backend``), so the
override is registered for that enum member; the registry's ``get_path`` honours overrides.
Installed by the proposer's constructor, which vLLM runs before it builds the model (and so
before layers pick their backend), only when RECAP verifies trees.
"""
from __future__ import annotations

from vllm_recap.patches import target

SEAM = "attention backend registry (register_backend)"

CPU_BACKEND = "vllm_recap.vllm.cpu_backend.RecapCPUAttentionBackend"


def install(vllm_config) -> str | None:
    """Points the platform's attention backend at the tree-aware subclass.

    Returns:
        None when installed; else why trees cannot be verified here (nothing installed).
    """
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends import registry

    register = target(registry, "register_backend", SEAM, ["backend", "class_path"])
    enum = target(registry, "AttentionBackendEnum", SEAM)
    from vllm.v1.attention import selector

    # Layers resolve their backend through a cache keyed by the selector inputs; an engine
    # built earlier in this process would otherwise keep handing out the stock class.
    target(selector, "_cached_get_attn_backend", SEAM).cache_clear()
    if current_platform.is_cpu():
        register(enum.CPU_ATTN, CPU_BACKEND)
        return None
    if current_platform.is_cuda():
        from vllm_recap.vllm.cuda_recompute import install_cuda_backend

        return install_cuda_backend(vllm_config, register, enum)
    return f"tree verification supports CPU and CUDA, not {current_platform.device_name}"
