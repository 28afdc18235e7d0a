"""CPU attention backend with per-request tree masks (registered over vLLM's CPU_ATTN).

vLLM's CPU kernel is causal over slot order. For a request verifying a tree, slot order is
the flattened tree: a node would also see earlier siblings and cousins. This backend runs the
stock kernel for the whole batch, then recomputes the rows of tree requests with
:func:`~vllm_recap.vllm.attention_math.tree_attention` over the prefix read back from the paged
cache and the nodes' own K/V. It also stashes those K/V rows in the step context until the
step's acceptance is known, so accepted off-chain nodes can be written to their final slots.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    _get_attn_isa,
)

from vllm_recap.vllm.attention_math import tree_attention
from vllm_recap.vllm.context import StashedKV, StepContext
from vllm_recap.vllm.kv_layout import probe_layout
from vllm_recap.vllm.tree_backend import CHAIN_HINT, TreeAttentionMixin


@dataclass(frozen=True)
class CPUTreeTensors:
    """Per-step tensors of the tree requests, built once and reused by every layer.

    Attributes:
        masks: per tree, [n, n] bool ancestor mask.
        positions: per tree, [n] int64 node positions (prefix + depth).
        prefixes: per tree, committed prefix length P.
    """

    masks: list[torch.Tensor]
    positions: list[torch.Tensor]
    prefixes: list[int]

    @classmethod
    def build(cls, ctx: StepContext, attn_metadata) -> CPUTreeTensors:
        masks, positions, prefixes = [], [], []
        for tree in ctx.plan.trees:
            prefix = int(attn_metadata.seq_lens[tree.batch_index]) - tree.num_nodes
            masks.append(torch.from_numpy(tree.ancestor_mask))
            positions.append(torch.from_numpy(tree.depths) + prefix)
            prefixes.append(prefix)
        return cls(masks, positions, prefixes)


class RecapCPUAttentionImpl(TreeAttentionMixin, CPUAttentionBackendImpl):
    def tree_unsupported_reason(self) -> str | None:
        if self.alibi_slopes is not None or self.sinks is not None:
            return "ALiBi and attention sinks are not reproduced by the CPU tree path"
        if self.is_fp8_kv_cache:
            return "the CPU tree path does not read an fp8 KV cache"
        return None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        ctx = self.tree_step(attn_metadata)
        if ctx is None:
            return output
        reason = self.tree_unsupported_reason()  # refused at load: an invariant here
        if reason is not None:
            raise RuntimeError(f"vllm-recap tree verification: {reason}; {CHAIN_HINT}.")
        if not isinstance(ctx.backend_state, CPUTreeTensors):
            ctx.backend_state = CPUTreeTensors.build(ctx, attn_metadata)
        tensors: CPUTreeTensors = ctx.backend_state
        nb, kvh, bs, two_hs = kv_cache.shape
        layout = probe_layout(kv_cache.dtype, bs, two_hs // 2,
                              _get_attn_isa(kv_cache.dtype, bs, two_hs // 2, self.kv_cache_dtype))
        qsl = attn_metadata.query_start_loc
        out3 = output.view(output.shape[0], self.num_heads, self.head_size)
        q3 = query.view(query.shape[0], self.num_heads, self.head_size)
        for t, tree in enumerate(ctx.plan.trees):
            i, n = tree.batch_index, tree.num_nodes
            qs = int(qsl[i])
            k_pre, v_pre = layout.gather(kv_cache, attn_metadata.block_table[i],
                                         tensors.prefixes[t])
            k_tree, v_tree = key[qs:qs + n], value[qs:qs + n]
            out3[qs:qs + n] = tree_attention(
                q3[qs:qs + n], k_pre, v_pre, k_tree, v_tree, tensors.masks[t], self.scale,
                node_positions=tensors.positions[t], sliding_window=self.sliding_window,
                softcap=float(self.logits_soft_cap or 0.0))
            ctx.kv_stash.append(StashedKV(self, layer, kv_cache, i, k_tree.clone(),
                                          v_tree.clone(),
                                          attn_metadata.slot_mapping[qs:qs + n].clone()))
        return output


class RecapCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return RecapCPUAttentionImpl
