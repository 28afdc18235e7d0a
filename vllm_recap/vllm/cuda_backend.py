"""CUDA attention backend with per-request tree masks (registered over vLLM's FLASH_ATTN).

Plain subclasses of vLLM's FlashAttention classes; the tree math is in
:mod:`vllm_recap.vllm.cuda_recompute` (pure torch). vLLM imports this module by the path the
attention seam registers (``cuda_recompute.BACKEND_PATH``), only where RECAP verifies trees.

Full CUDA graphs would replay the stock kernel without running this Python, so the metadata
builder declares graph support only for single-token decode batches (which never hold a
tree); vLLM then falls back to piecewise graphs, where attention runs eagerly.
"""
from __future__ import annotations

from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from vllm_recap.vllm.cuda_recompute import (
    HeadConfig,
    check_supported,
    layer_reason,
    recompute_tree_rows,
)
from vllm_recap.vllm.tree_backend import TreeAttentionMixin


class RecapFlashAttentionImpl(TreeAttentionMixin, FlashAttentionImpl):
    def tree_unsupported_reason(self) -> str | None:
        return layer_reason(self)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        ctx = self.tree_step(attn_metadata)
        if ctx is None:
            return output
        check_supported(self, attn_metadata)
        # a layer sharing another layer's cache has nothing of its own to compact
        owner = None if self.kv_sharing_target_layer_name is not None else (self, layer)
        recompute_tree_rows(HeadConfig.from_impl(self), ctx, query, key, value, kv_cache,
                            attn_metadata, output, owner)
        return output


class RecapFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        # full graphs only for 1-token decode batches: a tree batch must run forward()
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


class RecapFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return RecapFlashAttentionImpl

    @staticmethod
    def get_builder_cls():
        return RecapFlashAttentionMetadataBuilder
