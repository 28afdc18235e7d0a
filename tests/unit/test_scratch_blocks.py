"""Scratch KV blocks for CPU tree attention: the scheduler never hands them out, and every
worker finds the same ids from its cache's size alone."""
from __future__ import annotations

import pytest

from vllm_recap.patches.scratch_blocks import reserve, scratch_block_count, scratch_block_ids

pytestmark = pytest.mark.unit


def test_reserved_blocks_are_never_allocated_or_freed():
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks=320, enable_caching=True, hash_block_size=16)
    free = pool.get_num_free_blocks()
    n = reserve(pool)
    assert n == scratch_block_count(320) == 20 and pool.get_num_free_blocks() == free - n
    handed = pool.get_new_blocks(pool.get_num_free_blocks())  # everything the pool has
    assert max(b.block_id for b in handed) < 320 - n
    pool.free_blocks(handed)
    assert pool.get_num_free_blocks() == free - n
    # the worker's view: the same ids, in kernel blocks (here 2 kernel blocks per block)
    assert list(scratch_block_ids(640, 16, 32)) == list(range(600, 640))


@pytest.mark.parametrize("blocks,expected", [(10, 0), (64, 16), (1456, 91), (100_000, 128)])
def test_scratch_is_a_small_bounded_share(blocks, expected):
    assert scratch_block_count(blocks) == expected
