"""CPU attention backend with per-request tree masks (registered over vLLM's CPU_ATTN).

vLLM's CPU kernel is causal over slot order. For a request verifying a tree, slot order is
the flattened tree: a node would also see earlier siblings and cousins. This backend runs the
stock kernel for the whole batch (exact for prefill, plain decode and chains), then recomputes
the rows of tree requests with :func:`tree_attention` over the prefix read back from the paged
cache and the nodes' own K/V. It also keeps those K/V rows until the step's acceptance is known,
so that accepted off-chain nodes can be written to their final slots (KV compaction).
"""
from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    _get_attn_isa,
)

from vllm_recap.vllm import step as step_mod
from vllm_recap.vllm.kv_layout import probe_layout
from vllm_recap.vllm.tree_attention import tree_attention


class RecapCPUAttentionImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        plan = step_mod.CURRENT
        if plan is None or not plan.trees or attn_metadata is None \
                or self.attn_type != AttentionType.DECODER:
            return output
        if self.alibi_slopes is not None or self.sinks is not None or self.is_fp8_kv_cache:
            raise RuntimeError(
                "vllm-recap tree verification does not support ALiBi, attention sinks or an fp8 "
                "KV cache; use speculative_config {'method': 'recap', 'draft_mode': 'chain'}.")
        nb, kvh, bs, two_hs = kv_cache.shape
        layout = probe_layout(kv_cache.dtype, bs, two_hs // 2,
                              _get_attn_isa(kv_cache.dtype, bs, two_hs // 2, self.kv_cache_dtype))
        qsl = attn_metadata.query_start_loc
        out3 = output.view(output.shape[0], self.num_heads, self.head_size)
        q3 = query.view(query.shape[0], self.num_heads, self.head_size)
        for tree in plan.trees:
            i, n = tree.batch_index, tree.num_nodes
            qs = int(qsl[i])
            seq_len = int(attn_metadata.seq_lens[i])
            prefix = seq_len - n
            k_pre, v_pre = layout.gather(kv_cache, attn_metadata.block_table[i], prefix)
            k_tree, v_tree = key[qs:qs + n], value[qs:qs + n]
            mask, pos = _tree_tensors(tree, prefix, query.device)
            out3[qs:qs + n] = tree_attention(
                q3[qs:qs + n], k_pre, v_pre, k_tree, v_tree, mask, self.scale,
                node_positions=pos, sliding_window=self.sliding_window,
                softcap=float(self.logits_soft_cap or 0.0))
            plan.kv_stash.append((self, layer, kv_cache, tree.batch_index, k_tree.clone(),
                          v_tree.clone(), attn_metadata.slot_mapping[qs:qs + n].clone()))
        return output


def _tree_tensors(tree: step_mod.TreeSlot, prefix: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    cached = tree.torch_cache.get("mask")
    if cached is None:
        cached = (torch.from_numpy(tree.ancestor_mask).to(device),
                  torch.from_numpy(tree.depths).to(device) + prefix)
        tree.torch_cache["mask"] = cached
    return cached


class RecapCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return RecapCPUAttentionImpl
