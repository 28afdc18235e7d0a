"""benchmarks.verify_cost's table: tree / chain is taken within a round (no engine)."""
from __future__ import annotations

import pytest

from benchmarks.verify_cost import to_markdown

pytestmark = pytest.mark.unit


def test_tree_over_chain_is_the_median_of_same_round_ratios():
    """Round 1 ran on a host twice as slow for every mode: ratios within a round stay 1.10,
    where medians of each mode taken apart over mismatched rounds would not."""
    rows = []
    for r, scale in ((0, 1.0), (1, 2.0), (2, 1.0)):
        chain = (30.0 if r != 2 else 40.0) * scale  # round 2: both dearer, same ratio
        rows += [dict(round=r, mode="plain", context=100, nodes=1, median_ms=20.0 * scale),
                 dict(round=r, mode="chain", context=100, nodes=5, median_ms=chain),
                 dict(round=r, mode="tree", context=100, nodes=5, median_ms=1.1 * chain),
                 dict(round=r, mode="paired-chain", context=100, nodes=5, median_ms=chain),
                 dict(round=r, mode="paired-tree", context=100, nodes=5,
                      median_ms=(1.02 + 0.01 * r) * chain)]
    meta = dict(model="m", dtype="bfloat16", cpu="cpu", date="d", steps=12)
    table = to_markdown(meta, rows)
    assert "3 round(s)" in table
    line = next(x for x in table.splitlines() if x.startswith("| 100 | 5 |"))
    assert line.endswith("| 1.10 [1.10-1.10] | 1.03 [1.02-1.04] |")
    assert "| 20.0 |" in line  # plain: median over rounds


# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x (K, V) x 2 bytes (bf16) per token.
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2


def test_the_default_cache_holds_every_forced_tree_in_scratch():
    """The 64-node row must time the path kernel, not the dense fallback a tree gets when
    RECAP's scratch reserve is short (it was at the old 512 MiB: 43 blocks for 48 paths)."""
    from benchmarks.verify_cost import forced_tree, parser
    from patches.scratch_blocks import scratch_block_count
    from patches.speculative_method import TREE_BLOCK_SIZE
    from vllm_recap.vllm.cpu_paths import scratch_blocks_needed

    args = parser().parse_args([])
    assert args.model == "smollm2"
    nodes = max(int(x) for x in args.nodes.split(","))
    tree = forced_tree(1, nodes, "tree", 49152).depth_first()  # as the driver sends it
    blocks = args.kv_cache_mib * 2**20 // (SMOLLM2_KV_BYTES_PER_TOKEN * TREE_BLOCK_SIZE)
    for context in (int(x) for x in args.contexts.split(",")):
        for prefix in range(context, context + 4 * args.steps + 8):  # the paired run's 2x
            need = scratch_blocks_needed(tree.parents, prefix, TREE_BLOCK_SIZE)
            assert need <= scratch_block_count(blocks), (context, prefix, need)
