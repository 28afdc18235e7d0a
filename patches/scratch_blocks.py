"""Seam: a few KV cache blocks the scheduler never hands out, as scratch for tree attention.

RECAP's CPU tree attention runs inside vLLM's own paged kernel by giving each root-to-leaf
path of a tree a *virtual request* whose block table is the request's real prefix blocks plus
scratch blocks holding that path's K/V (vllm_recap/vllm/cpu_paths.py). Those blocks must be
part of the layer's KV cache tensor yet never allocated to a request. The scheduler (engine
core process) removes the last ``scratch_block_count(num_blocks)`` blocks of its block pool
from the free list at start; each worker derives the same ids from its cache's size alone,
so nothing has to travel between processes. Only engines that verify trees on CPU reserve.
"""
from __future__ import annotations

import logging

from vllm_recap.patches import target, wrap

SEAM = "Scheduler.__init__ (scratch KV blocks for tree attention)"
logger = logging.getLogger("vllm.recap")


def scratch_block_count(num_blocks: int) -> int:
    """Manager blocks kept out of the pool: 1/16 of the cache, 16 to 128 (0 below 64 blocks).

    A step needs, per tree path other than its best chain, 1 or 2 blocks (exactly
    ``cpu_paths.scratch_blocks_needed``): a bushy 17-node tree ~11, a chain-like one ~3.
    Trees that do not fit fall back to the dense path, exact but slower.
    """
    if num_blocks < 64:
        return 0
    return min(128, max(16, num_blocks // 16))


def scratch_block_ids(num_kernel_blocks: int, kernel_block_size: int,
                      manager_block_size: int) -> range:
    """The scratch block ids of a layer's cache tensor (in kernel blocks)."""
    per = max(1, manager_block_size // kernel_block_size)
    reserved = scratch_block_count(num_kernel_blocks // per) * per
    return range(num_kernel_blocks - reserved, num_kernel_blocks)


def _reserves(vllm_config) -> bool:
    from vllm.platforms import current_platform

    from vllm_recap.patches.requests import is_recap

    options = (vllm_config.additional_config or {}).get("recap") or {}
    return (current_platform.is_cpu() and is_recap(vllm_config.speculative_config)
            and options.get("draft_mode", "tree") == "tree")


def install() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    def make(original):
        def __init__(self, vllm_config, *args, **kwargs):
            original(self, vllm_config, *args, **kwargs)
            if _reserves(vllm_config):
                reserve(self.kv_cache_manager.block_pool)

        return __init__

    wrap(Scheduler, "__init__", SEAM, ["self", "vllm_config", "kv_cache_config"], make)


def reserve(pool) -> int:
    """Takes the pool's last blocks out of its free list for good; returns how many."""
    target(pool, "free_block_queue", SEAM)
    n = scratch_block_count(pool.num_gpu_blocks)
    for block in pool.blocks[pool.num_gpu_blocks - n:]:
        pool.free_block_queue.remove(block)
        block.ref_cnt = 1  # held forever: never freed, never evicted
    if n:
        logger.info("vllm-recap: %d of %d KV cache blocks reserved as tree-attention scratch",
                    n, pool.num_gpu_blocks)
    return n
