"""CPU attention backend with per-request tree masks (registered over vLLM's CPU_ATTN).

vLLM's CPU kernel is causal over slot order. For a request verifying a tree, slot order is
the flattened tree: a node would also see earlier siblings and cousins. In a step with trees
this backend runs vLLM's own kernel once for the whole batch with every tree split into
root-to-leaf *virtual requests* (:mod:`~vllm_recap.vllm.cpu_paths`): each path's causal view
is exactly a node's ancestors, read through scratch blocks the scheduler keeps out of its pool
(``patches/scratch_blocks.py``). Trees that do not fit the scratch are recomputed densely.
The nodes' K/V are stashed in the step context for KV compaction. Steps without trees run the
stock forward unchanged.
"""
from __future__ import annotations

from vllm.config import get_current_vllm_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_recap.patches.scratch_blocks import scratch_block_ids
from vllm_recap.vllm.cpu_paths import forward_with_paths, step_virtual_batch
from vllm_recap.vllm.tree_backend import CHAIN_HINT, TreeAttentionMixin


class RecapCPUAttentionImpl(TreeAttentionMixin, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cache = getattr(get_current_vllm_config(), "cache_config", None)
        # the scheduler's block size; the cache's kernel blocks may split it (scratch ids)
        self._manager_block_size = getattr(cache, "block_size", None)

    def tree_unsupported_reason(self) -> str | None:
        if self.alibi_slopes is not None or self.sinks is not None:
            return "ALiBi and attention sinks are not reproduced by the CPU tree path"
        if self.is_fp8_kv_cache:
            return "the CPU tree path does not read an fp8 KV cache"
        return None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        ctx = self.tree_step(attn_metadata)
        if ctx is None or output_scale is not None or output_block_scale is not None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        reason = self.tree_unsupported_reason()  # refused at load: an invariant here
        if reason is not None:
            raise RuntimeError(f"vllm-recap tree verification: {reason}; {CHAIN_HINT}.")
        block_size = kv_cache.shape[2]
        batch = step_virtual_batch(ctx, attn_metadata, block_size,
                                   lambda: scratch_block_ids(kv_cache.shape[0], block_size,
                                                             self._manager_block_size
                                                             or block_size))
        return forward_with_paths(self, layer, query, key, value, kv_cache, attn_metadata,
                                  batch, output, ctx)


class RecapCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return RecapCPUAttentionImpl
