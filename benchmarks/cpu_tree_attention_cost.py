"""One attention layer's cost on CPU: vLLM's kernel on a chain vs tree paths vs the old path.

For each dtype, prefix length and node count n, one request verifies n tokens at one layer
(SmolLM2 shapes by default: 9 heads, 3 KV heads, head 64, block 128) and three forwards are
timed, interleaved, median of ``--repeats``:

- ``stock``: vLLM's CPU attention forward on a chain of n tokens (what a chain pass costs);
- ``paths``: :func:`vllm_recap.vllm.cpu_paths.forward_with_paths` on a tree of n nodes
  (scratch copies and writes, q/output permutation, one kernel call);
- ``old``: the previous tree path (stock kernel, then gather + dense recompute of the tree).

Trees are "bushy" (chain of n/4, then breadth-first, 3 children per node) or "chain-like"
(chain of n/2, side chains of 3). ``build_us`` is the once-per-step cost of
``VirtualBatch.build`` plus the kernel's scheduler metadata (shared by all layers).
Before each timed call ``--evict-mib`` of memory is written, as the rest of a forward pass
(other layers' weights and caches) would: the layer's KV cache and scratch start cold.

    python benchmarks/cpu_tree_attention_cost.py
    python benchmarks/cpu_tree_attention_cost.py --dtypes float32 --prefixes 500 --repeats 50
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_recap.core.tree import DraftTree  # noqa: E402
from vllm_recap.vllm.context import StepContext, StepScope  # noqa: E402
from vllm_recap.vllm.cpu_paths import VirtualBatch, forward_with_paths  # noqa: E402
from vllm_recap.vllm.layout import build_plan, chain_parents  # noqa: E402


def bushy(n: int) -> np.ndarray:
    """Chain 0..max(1, n/4), then nodes attached breadth-first, at most 3 children each."""
    last = min(max(1, n // 4), n - 1)
    parents, kids = list(range(-1, last)), [1] * last + [0]
    frontier = 0
    for _ in range(last + 1, n):
        while kids[frontier] >= 3:
            frontier += 1
        parents.append(frontier)
        kids[frontier] += 1
        kids.append(0)
    return np.array(parents, np.int64)


def chain_like(n: int) -> np.ndarray:
    """Chain 0..n/2, then side chains of 3 nodes branching off chain nodes 0, 1, 2, ..."""
    last = max(n // 2, min(n - 1, 1))
    parents = list(range(-1, last))
    branch = 0
    while len(parents) < n:
        prev = branch
        for _ in range(min(3, n - len(parents))):
            parents.append(prev)
            prev = len(parents) - 1
        branch += 1
    return np.array(parents, np.int64)


def make_case(parents: np.ndarray, prefix: int, dtype: torch.dtype, args, seed: int = 0):
    """One request with `prefix` tokens cached and the nodes' K/V in their real slots."""
    from vllm import _custom_ops as ops
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, _get_attn_isa

    from vllm_recap.vllm.cpu_backend import RecapCPUAttentionImpl

    h, kvh, hs, bs, n = args.heads, args.kv_heads, args.head_size, args.block_size, len(parents)
    fake = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype),
                           parallel_config=SimpleNamespace(decode_context_parallel_size=1))
    with set_current_vllm_config(fake):
        impl = RecapCPUAttentionImpl(num_heads=h, head_size=hs, scale=hs ** -0.5,
                                     num_kv_heads=kvh, alibi_slopes=None, sliding_window=None,
                                     kv_cache_dtype="auto")
    isa = _get_attn_isa(dtype, bs, hs, "auto")
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    g = torch.Generator().manual_seed(seed)
    nblk = -(-(prefix + n) // bs)
    scratch = 2 * n + 2
    kv_cache = torch.randn(nblk + scratch, kvh, bs, 2 * hs, generator=g).to(dtype)
    k = torch.randn(prefix + n, kvh, hs, generator=g).to(dtype)
    v = torch.randn(prefix + n, kvh, hs, generator=g).to(dtype)
    slots = torch.arange(prefix + n, dtype=torch.int64)
    impl.do_kv_cache_update(layer, k, v, kv_cache, slots)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    seq_lens = torch.tensor([prefix + n], dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=h, num_kv_heads=kvh, head_dim=hs, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=True)
    meta = CPUAttentionMetadata(
        num_actual_tokens=n, max_query_len=n, query_start_loc=qsl, max_seq_len=prefix + n,
        seq_lens=seq_lens, block_table=torch.arange(nblk, dtype=torch.int32)[None],
        slot_mapping=slots[prefix:], scheduler_metadata=sched)
    tree = DraftTree(np.zeros(n, np.int64), parents, np.ones(n))
    plan = build_plan(["r"], np.array([n]), np.array([0, n]), {"r": [0] * (n - 1)},
                      {"r": tree}, np.array([prefix]), np.array([1]))
    return SimpleNamespace(
        impl=impl, layer=layer, kv_cache=kv_cache, meta=meta, plan=plan,
        scratch=list(range(nblk, nblk + scratch)), query=torch.randn(n, h, hs).to(dtype),
        key=k[prefix:], value=v[prefix:], out=torch.empty(n, h * hs, dtype=dtype))


def _stock(c):
    super(type(c.impl), c.impl).forward(c.layer, c.query, c.key, c.value, c.kv_cache, c.meta,
                                        c.out)


def _median_us(fns: dict, repeats: int, evict: torch.Tensor | None) -> dict:
    # One thread: its CPU time is all the work (OpenMP and torch run in the caller), and unlike
    # wall time it does not count the time a busy host gives to other processes.
    clock = time.thread_time_ns if torch.get_num_threads() == 1 else time.perf_counter_ns
    samples = {name: [] for name in fns}
    for name, fn in fns.items():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved: drift hits every method alike
            if evict is not None:  # a pass's other layers leave nothing of this one in cache
                evict.add_(1)
            t0 = clock()
            fn()
            samples[name].append(clock() - t0)
    return {name: statistics.median(s) / 1e3 for name, s in samples.items()}


def run(args) -> list[dict]:
    rows = []
    evict = torch.zeros(args.evict_mib << 18) if args.evict_mib > 0 else None
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for prefix in (int(p) for p in args.prefixes.split(",")):
            for n in (int(s) for s in args.sizes.split(",")):
                shapes = [("decode", chain_parents(1))] if n == 1 else \
                    [("bushy", bushy(n)), ("chain-like", chain_like(n))]
                chain = make_case(chain_parents(n), prefix, dtype, args)
                for shape, parents in shapes:
                    c = make_case(parents, prefix, dtype, args)
                    ctx, scope = StepContext(c.plan), StepScope()
                    c.impl.bind_step_scope(scope)
                    scope.install(ctx)

                    def build(c=c):
                        vb = VirtualBatch.build(c.plan, c.meta, args.block_size, c.scratch)
                        vb.scheduler_metadata(c.impl, c.query.dtype, c.layer.isa)
                        return vb

                    vb = build()

                    def paths(c=c, ctx=ctx, vb=vb):
                        forward_with_paths(c.impl, c.layer, c.query, c.key, c.value,
                                           c.kv_cache, c.meta, vb, c.out, ctx)
                        ctx.kv_stash.clear()

                    def old(c=c, ctx=ctx):
                        c.impl.forward(c.layer, c.query, c.key, c.value, c.kv_cache, c.meta,
                                       c.out)
                        ctx.kv_stash.clear()

                    fns = {"stock": lambda: _stock(chain), "paths": paths, "old": old,
                           "build": build}
                    if n == 1:
                        fns = {"stock": lambda: _stock(chain), "paths": paths}
                    t = _median_us(fns, args.repeats, evict)
                    rows.append(dict(dtype=dtype_name, prefix=prefix, n=n, shape=shape,
                                     paths_scratch=vb.scratch_used,
                                     stock_us=t["stock"], paths_us=t["paths"],
                                     old_us=t.get("old", float("nan")),
                                     build_us=t.get("build", 0.0)))
    return rows


def markdown(rows: list[dict]) -> str:
    head = ("| dtype | prefix | n | tree | scratch | stock us | paths us | old us | "
            "paths/stock | old/stock | paths-stock us | build us/step |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['prefix']} | {r['n']} | {r['shape']} | {r['paths_scratch']} "
            f"| {r['stock_us']:.0f} | {r['paths_us']:.0f} | {r['old_us']:.0f} "
            f"| {r['paths_us'] / r['stock_us']:.2f} | {r['old_us'] / r['stock_us']:.2f} "
            f"| {r['paths_us'] - r['stock_us']:.0f} | {r['build_us']:.0f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prefixes", default="100,500,1000")
    p.add_argument("--sizes", default="1,5,9,17,33,64", help="tree nodes (root included)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--evict-mib", type=int, default=64,
                   help="write this much memory before each timed call (0: hot caches)")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--threads", type=int, default=0,
                   help="torch/OpenMP threads (0: torch's default); 1 is steadier on a busy host")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # vLLM's bfloat16 kernel uses AMX tiles where the CPU has them, and Linux kills a process
    # that touches them before asking for their state (the engine's worker asks; this script
    # calls the kernel without one)
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
    rows = run(args)
    print(f"torch threads {torch.get_num_threads()} "
          f"({'thread CPU time' if torch.get_num_threads() == 1 else 'wall time'}), "
          f"block {args.block_size}, heads {args.heads}/{args.kv_heads}, head size "
          f"{args.head_size}, evict {args.evict_mib} MiB, median of {args.repeats}")
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
