"""Verify cost of draft trees at Qwen2.5-VL-7B text shape, and checks of the CUDA tree path.

(a) forward: one target decoder step over k tree tokens (k = 1: plain decode) on a P-token
    prefix, at the 7B text shape with random bf16 weights (hidden 3584, 28 layers, 28 heads,
    4 KV heads, head 128, MLP 18944, vocab 152064), logits for every node. A small decoder in
    plain torch (RMSNorm, RoPE at prefix + depth, tree-masked attention over a static KV
    cache, SwiGLU); on CUDA each step is a CUDA graph, timed with CUDA events.
(b) checks: vllm_recap's tree recompute (torch prefix part; vLLM's FlashAttention prefix part
    when vLLM's CUDA build imports) over a synthetic paged cache vs the dense fp32 reference,
    with poisoned outputs; the decoder's own attention vs the reference; decoder tree rows vs
    chain forwards over each node's path (fp32, 2 layers at the same width).
(c) overhead: time of one layer's tree recompute, the extra work per attention layer.

    python benchmarks/gpu_tree_verify.py            # GPU, 7B shape (~16 GB of GPU memory)
    python benchmarks/gpu_tree_verify.py --small    # tiny CPU smoke run, seconds

Needs torch only (vLLM optional). Writes gpu_tree_verify.{json,md} under --out.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reference_attention import tree_reference, visible  # noqa: E402
from vllm_recap.vllm import cuda_recompute as cb  # noqa: E402  (torch-only at import)
from vllm_recap.vllm.attention_math import masked_attention  # noqa: E402
from vllm_recap.vllm.context import StepContext, TreeSlot  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "gpu"


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 1e6
    eps: float = 1e-6


QWEN25VL_7B = Shape(3584, 28, 28, 4, 128, 18944, 152064)
SMALL = Shape(64, 2, 4, 2, 16, 128, 512)


def random_tree(n: int, rng: np.random.Generator) -> np.ndarray:
    """[n] parents of a random parents-first tree (root -1); never a chain when n > 2."""
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int64)
    if n > 2:
        parents[2] = 0  # nodes 1 and 2 are siblings
    return parents


def tree_mask(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(depths [n], ancestor mask [n, n]) from the independent test reference."""
    depths = np.zeros(len(parents), np.int64)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths, visible(list(parents), 0).numpy()


# ----------------------------------------------------------------------------- decoder
def init_weights(s: Shape, device, dtype, seed: int = 0) -> dict:
    gen = torch.Generator(device=device).manual_seed(seed)

    def w(*shape, std=0.02):
        return torch.empty(*shape, device=device, dtype=dtype).normal_(0, std, generator=gen)

    qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    ones = lambda: torch.ones(s.hidden, device=device, dtype=dtype)  # noqa: E731
    layers = [dict(ln1=ones(), wqkv=w(s.hidden, qkv), bqkv=w(qkv),
                   wo=w(s.heads * s.head_dim, s.hidden), ln2=ones(),
                   wgu=w(s.hidden, 2 * s.intermediate), wd=w(s.intermediate, s.hidden))
              for _ in range(s.layers)]
    return dict(embed=w(s.vocab, s.hidden, std=1.0), layers=layers, norm=ones(),
                lm_head=w(s.hidden, s.vocab))


def _rms(x, w, eps):
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x, positions, theta):
    """Qwen2 rotate-half RoPE on [k, heads, D] at the given positions [k]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = positions.float()[:, None] * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x.float().chunk(2, -1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def decoder_attention(q, k, v, allowed, scale, impl: str = "matmul"):
    """q [n, H, D] over k, v [KVH, S, D] where allowed [n, S]; returns [n, H * D].

    "matmul" is the project's own masked attention (query heads grouped per KV head, no K/V
    copies, float32 scores); "sdpa" expands K/V per query head and calls torch SDPA.
    """
    n, h, d = q.shape
    kvh = k.shape[0]
    if impl == "sdpa":
        g = h // kvh
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.repeat_interleave(g, 0)[None],
            v.repeat_interleave(g, 0)[None], attn_mask=allowed[None, None], scale=scale)
        return out[0].transpose(0, 1).reshape(n, h * d)
    out, _ = masked_attention(q, k.transpose(0, 1), v.transpose(0, 1), allowed, scale,
                              need_lse=False)
    return out.to(q.dtype).reshape(n, h * d)


def decoder_step(wts, s: Shape, cache, ids, positions, allowed, prefix: int, impl: str):
    """Logits [k, vocab] of k new tokens written at cache slots prefix..prefix+k-1.

    cache: per layer (K, V), each [KVH, >= prefix + k, D]; allowed: [k, prefix + k] bool.
    """
    k_new, hd = ids.shape[0], s.heads * s.head_dim
    x = wts["embed"][ids]
    for lw, (kc, vc) in zip(wts["layers"], cache):
        qkv = _rms(x, lw["ln1"], s.eps) @ lw["wqkv"] + lw["bqkv"]
        q, kk, vv = qkv.split([hd, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
        q = _rope(q.view(k_new, s.heads, s.head_dim), positions, s.rope_theta)
        kk = _rope(kk.view(k_new, s.kv_heads, s.head_dim), positions, s.rope_theta)
        kc[:, prefix:prefix + k_new] = kk.transpose(0, 1)
        vc[:, prefix:prefix + k_new] = vv.view(k_new, s.kv_heads, s.head_dim).transpose(0, 1)
        att = decoder_attention(q, kc[:, :prefix + k_new], vc[:, :prefix + k_new], allowed,
                                s.head_dim ** -0.5, impl)
        x = x + att @ lw["wo"]
        gate, up = (_rms(x, lw["ln2"], s.eps) @ lw["wgu"]).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ lw["wd"]
    return _rms(x, wts["norm"], s.eps) @ wts["lm_head"]


def step_inputs(s: Shape, prefix: int, parents: np.ndarray, device, gen=None):
    depths, mask = tree_mask(parents)
    n = len(parents)
    allowed = torch.ones(n, prefix + n, dtype=torch.bool)
    allowed[:, prefix:] = torch.from_numpy(mask)
    ids = torch.randint(0, s.vocab, (n,), generator=gen)
    return ids.to(device), torch.from_numpy(depths + prefix).to(device), allowed.to(device)


# ----------------------------------------------------------------------------- timing
def _timed(fn, repeats: int, warmup: int, device) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _graphed(fn, device):
    """fn replayed as a CUDA graph (launch overhead would otherwise dominate k = 1)."""
    if device.type != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _stats(times: list[float]) -> dict:
    q = np.percentile(times, [10, 50, 90])
    return dict(median_ms=float(q[1]), p10_ms=float(q[0]), p90_ms=float(q[2]),
                min_ms=min(times), max_ms=max(times), runs=len(times))


def bench_forward(args, s: Shape, device, dtype) -> list[dict]:
    wts = init_weights(s, device, dtype)
    rng, rows = np.random.default_rng(0), []
    for prefix in args.prefixes:
        size = (s.kv_heads, prefix + max(args.trees), s.head_dim)
        cache = [(torch.randn(size, device=device, dtype=dtype),
                  torch.randn(size, device=device, dtype=dtype)) for _ in range(s.layers)]
        for k in args.trees:
            ids, pos, allowed = step_inputs(s, prefix, random_tree(k, rng), device)
            with torch.no_grad():
                run = _graphed(lambda: decoder_step(wts, s, cache, ids, pos, allowed, prefix,
                                                    args.attn), device)
                rows.append(dict(prefix=prefix, tree_tokens=k,
                                 **_stats(_timed(run, args.repeats, args.warmup, device))))
            del run
    base = {r["prefix"]: r["median_ms"] for r in rows if r["tree_tokens"] == min(args.trees)}
    for r in rows:
        r["ratio_vs_min"] = r["median_ms"] / base[r["prefix"]]
    return rows


# ----------------------------------------------------------------------------- checks
def synthetic_step(device, dtype, heads: int, kv_heads: int, head_dim: int, requests: list,
                   block_size: int = 16, seed: int = 0) -> SimpleNamespace:
    """One engine step over a paged FlashAttention-layout cache (token-major storage).

    Args:
        requests: (prefix length, parents) per request; a tree request is any non-chain with
            > 2 nodes, the others stand for decode/prefill rows the recompute must not touch.

    Returns:
        cache, query/key/value [T, *, D], md (query_start_loc, seq_lens, block_table,
        slot_mapping), ctx (a step context: plan.trees, kv_stash), qsl, and per request
        (q, K, V over prefix + n).
    """
    g = torch.Generator().manual_seed(seed)
    need = [-(-(p + len(par)) // block_size) for p, par in requests]
    perm = torch.randperm(sum(need) + 3, generator=g)  # scattered blocks, some unused
    cache = torch.zeros(len(perm), block_size, kv_heads, 2 * head_dim, dtype=dtype)
    cache = cache.permute(0, 2, 1, 3)  # logical [blocks, kvh, bs, 2D] over token-major storage
    qs, seqs, slots, table, trees, off, used = [], [], [], [], [], 0, 0
    for b, ((prefix, parents), nb) in enumerate(zip(requests, need)):
        n = len(parents)
        k = torch.randn(prefix + n, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(prefix + n, kv_heads, head_dim, generator=g).to(dtype)
        blocks = perm[used:used + nb]
        used += nb
        pos = torch.arange(prefix + n)
        slot = blocks[pos // block_size] * block_size + pos % block_size
        cache[slot // block_size, :, slot % block_size] = torch.cat([k, v], -1)
        qs.append(torch.randn(n, heads, head_dim, generator=g).to(dtype))
        seqs.append((k, v))
        slots.append(slot[prefix:])
        table.append(blocks)
        depths, mask = tree_mask(parents)
        if n > 2 and not np.array_equal(parents, np.arange(-1, n - 1)):
            trees.append(TreeSlot(b, off, parents, depths, mask))
        off += n
    width = max(need)
    block_table = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in table]).int()
    qsl = torch.tensor([0, *np.cumsum([len(p) for _, p in requests])], dtype=torch.int32)
    seq_lens = torch.tensor([p + len(par) for p, par in requests], dtype=torch.int32)
    md = SimpleNamespace(query_start_loc=qsl.to(device), block_table=block_table.to(device),
                         seq_lens=seq_lens.to(device), slot_mapping=torch.cat(slots).to(device))
    key = torch.cat([k[p:] for (k, _), (p, _) in zip(seqs, requests)])
    value = torch.cat([v[p:] for (_, v), (p, _) in zip(seqs, requests)])
    return SimpleNamespace(cache=cache.to(device), query=torch.cat(qs).to(device),
                           key=key.to(device), value=value.to(device), md=md,
                           ctx=StepContext(SimpleNamespace(trees=trees)), qsl=qsl, qs=qs,
                           seqs=seqs, requests=requests)


def dense_reference(step, tree, scale: float, window: int = -1, softcap: float = 0.0):
    """fp32 dense tree attention of one tree request ([n, H, D]), the tests' reference."""
    prefix, parents = step.requests[tree.batch_index]
    k, v = (t.float() for t in step.seqs[tree.batch_index])
    return tree_reference(step.qs[tree.batch_index].float(), k, v, parents, prefix, scale,
                          window, softcap)


def check_recompute(step, cfg: cb.HeadConfig, tol: float) -> dict:
    """Runs the recompute into a NaN-poisoned output; tree rows vs reference, others untouched."""
    out = torch.full((step.query.shape[0], cfg.num_heads * cfg.head_size), float("nan"),
                     dtype=step.query.dtype, device=step.query.device)
    cb.recompute_tree_rows(cfg, step.ctx, step.query, step.key, step.value, step.cache, step.md,
                           out)
    out = out.view(-1, cfg.num_heads, cfg.head_size).float().cpu()
    written, err = torch.zeros(out.shape[0], dtype=torch.bool), 0.0
    for tree in step.ctx.plan.trees:
        a, b = int(step.qsl[tree.batch_index]), int(step.qsl[tree.batch_index + 1])
        written[a:b] = True
        ref = dense_reference(step, tree, cfg.scale, cfg.sliding_window, cfg.softcap)
        err = max(err, float((out[a:b] - ref).abs().max()))  # NaN rows make err NaN -> fail
    untouched = bool(torch.isnan(out[~written]).all())
    return dict(max_abs_err=err, tol=tol, passed=bool(err <= tol) and untouched,
                untouched=untouched)


def flash_version() -> int | None:
    """The FlashAttention version vLLM would use here (3 on Hopper, else 2), None without it."""
    if not torch.cuda.is_available() or cb.flash_varlen_func() is None:
        return None
    from vllm.vllm_flash_attn import is_fa_version_supported

    return 3 if torch.cuda.get_device_capability()[0] == 9 and is_fa_version_supported(3) else 2


def run_checks(args, s: Shape, device, dtype) -> list[dict]:
    rng = np.random.default_rng(1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    prefixes = [37, 70] if args.small else [1000, 1537]
    requests = [(prefixes[0], random_tree(16, rng)), (5, np.arange(-1, 2)),
                (prefixes[1], random_tree(48, rng))]
    step = synthetic_step(device, dtype, s.heads, s.kv_heads, s.head_dim, requests)
    cfg = cb.HeadConfig(s.heads, s.head_dim, s.head_dim ** -0.5)
    checks = []
    for name, c in [("recompute_torch", cfg),
                    ("recompute_torch_softcap", replace(cfg, softcap=20.0)),
                    ("recompute_torch_window", replace(cfg, sliding_window=prefixes[0] // 2))]:
        checks.append(dict(name=name, **check_recompute(step, c, tol)))
        step.ctx.backend_state = None
    fa = flash_version() if device.type == "cuda" else None
    for name, c in [("recompute_flash", replace(cfg, fa_version=fa)),
                    ("recompute_flash_softcap", replace(cfg, fa_version=fa, softcap=20.0))]:
        if fa is None:
            checks.append(dict(name=name, passed=None,
                               note="skipped: vLLM FlashAttention not importable"))
            continue
        checks.append(dict(name=name, fa_version=fa, **check_recompute(step, c, tol)))
        step.ctx.backend_state = None
    tree = step.ctx.plan.trees[0]
    prefix, _ = requests[tree.batch_index]
    k, v = (t.to(device).transpose(0, 1) for t in step.seqs[tree.batch_index])
    allowed = torch.ones(tree.num_nodes, prefix + tree.num_nodes, dtype=torch.bool)
    allowed[:, prefix:] = torch.from_numpy(tree.ancestor_mask)
    ref = dense_reference(step, tree, cfg.scale).reshape(tree.num_nodes, -1)
    for impl in ("matmul", "sdpa"):
        got = decoder_attention(step.qs[tree.batch_index].to(device), k, v, allowed.to(device),
                                cfg.scale, impl)
        err = float((got.float().cpu() - ref).abs().max())
        checks.append(dict(name=f"decoder_attention_{impl}", max_abs_err=err, tol=tol,
                           passed=err <= tol))
    checks.append(check_decoder_tree_vs_chain(s, device, args.small))
    return checks


def check_decoder_tree_vs_chain(s: Shape, device, small: bool) -> dict:
    """fp32, 2 layers at the shape's width: tree logits row i == chain forward over path(i)."""
    s2 = replace(s, layers=2, vocab=min(s.vocab, 4096))
    wts = init_weights(s2, device, torch.float32, seed=3)
    prefix, parents = (24 if small else 300), random_tree(12, np.random.default_rng(2))
    depths, _ = tree_mask(parents)
    cache = [(torch.randn(s2.kv_heads, prefix + 12, s2.head_dim, device=device),
              torch.randn(s2.kv_heads, prefix + 12, s2.head_dim, device=device)) for _ in range(2)]
    ids, pos, allowed = step_inputs(s2, prefix, parents, device, torch.Generator().manual_seed(4))
    with torch.no_grad():
        tree_logits = decoder_step(wts, s2, cache, ids, pos, allowed, prefix, "matmul")
        err = 0.0
        for i in range(len(parents)):
            path, j = [], i
            while j >= 0:
                path.append(j)
                j = int(parents[j])
            path = torch.tensor(path[::-1], device=device)
            causal = torch.ones(len(path), prefix + len(path), dtype=torch.bool, device=device)
            causal = causal.tril(prefix)  # prefix + the path up to each position
            chain = decoder_step(wts, s2, cache, ids[path], pos[path], causal, prefix, "matmul")
            err = max(err, float((chain[-1] - tree_logits[i]).abs().max()))
    tol = 1e-3 * max(1.0, float(tree_logits.abs().max()))
    return dict(name="decoder_tree_vs_chain_fp32", max_abs_err=err, tol=tol, passed=err <= tol,
                max_depth=int(depths.max()))


def bench_overhead(args, s: Shape, device, dtype) -> list[dict]:
    fa = flash_version() if device.type == "cuda" else None
    cfg = cb.HeadConfig(s.heads, s.head_dim, s.head_dim ** -0.5, fa_version=fa)
    rng, rows = np.random.default_rng(5), []
    for prefix in args.prefixes:
        for k in [t for t in args.trees if t > 2]:
            step = synthetic_step(device, dtype, s.heads, s.kv_heads, s.head_dim,
                                  [(prefix, random_tree(k, rng))])
            out = torch.empty(k, s.heads * s.head_dim, dtype=dtype, device=device)

            def run():  # one layer; the step's TreeBatch is built once (first call) and reused
                cb.recompute_tree_rows(cfg, step.ctx, step.query, step.key, step.value,
                                       step.cache, step.md, out)

            t = _stats(_timed(run, args.repeats, args.warmup, device))
            rows.append(dict(prefix=prefix, tree_tokens=k, path="flash" if fa else "torch",
                             median_us=t["median_ms"] * 1e3, p90_us=t["p90_ms"] * 1e3))
    return rows


# ----------------------------------------------------------------------------- report
def to_markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"# Tree verify cost ({m['device_name']}, {m['dtype']}, shape {m['shape_name']})", "",
             f"{m['date']}; torch {m['torch']}; attention `{m['attn']}`; "
             f"CUDA graphs {m['cuda_graph']}; {m['repeats']} timed runs after {m['warmup']} "
             "warm-up.", "",
             "## (a) decoder step: k tree tokens on a P-token prefix", "",
             "| prefix P | tree tokens k | median ms | p10-p90 ms | min-max ms | x k=min |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in result["forward"]:
        lines.append(f"| {r['prefix']} | {r['tree_tokens']} | {r['median_ms']:.3f} | "
                     f"{r['p10_ms']:.3f}-{r['p90_ms']:.3f} | {r['min_ms']:.3f}-{r['max_ms']:.3f} | "
                     f"{r['ratio_vs_min']:.2f} |")
    lines += ["", "## (b) checks", "", "| check | passed | max abs err | tol | note |",
              "|---|---|---:|---:|---|"]
    for c in result["checks"]:
        err = "" if "max_abs_err" not in c else f"{c['max_abs_err']:.2e}"
        tol = "" if "tol" not in c else f"{c['tol']:.0e}"
        lines.append(f"| {c['name']} | {c['passed']} | {err} | {tol} | {c.get('note', '')} |")
    lines += ["", "## (c) tree recompute, one attention layer", "",
              "| prefix P | tree tokens | path | median us | p90 us |", "|---:|---:|---|---:|---:|"]
    for r in result["overhead"]:
        lines.append(f"| {r['prefix']} | {r['tree_tokens']} | {r['path']} | "
                     f"{r['median_us']:.1f} | {r['p90_us']:.1f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shape on CPU (smoke test)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --small)")
    p.add_argument("--prefixes", type=int, nargs="+", default=None, help="default 1024 2048")
    p.add_argument("--trees", type=int, nargs="+", default=None, help="default 1 8 16 32 64 128")
    p.add_argument("--repeats", type=int, default=None, help="timed runs (default 20; 3 small)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--attn", choices=["matmul", "sdpa"], default="matmul")
    p.add_argument("--skip-forward", action="store_true", help="checks and overhead only")
    args = p.parse_args(argv)
    args.prefixes = args.prefixes or ([32, 64] if args.small else [1024, 2048])
    args.trees = args.trees or ([1, 4, 8] if args.small else [1, 8, 16, 32, 64, 128])
    args.repeats = args.repeats or (3 if args.small else 20)
    if args.small:
        args.warmup = min(args.warmup, 1)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.small
    device = torch.device(args.device or ("cuda" if cuda else "cpu"))
    shape, name = (SMALL, "small") if args.small else (QWEN25VL_7B, "qwen2.5-vl-7b-text")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    on_gpu = device.type == "cuda"
    device_name = torch.cuda.get_device_name(device) if on_gpu else platform.processor() or "cpu"
    result = dict(meta=dict(
        date=dt.datetime.now().isoformat(timespec="seconds"), platform=platform.platform(),
        torch=torch.__version__, device=str(device), dtype=str(dtype).replace("torch.", ""),
        device_name=device_name, shape_name=name, shape=asdict(shape), attn=args.attn,
        cuda_graph=on_gpu, repeats=args.repeats, warmup=args.warmup,
        flash_version=flash_version() if on_gpu else None))
    threads = torch.get_num_threads()
    if device.type == "cpu" and args.small:
        torch.set_num_threads(1)  # tiny ops: threads only add contention on a shared CPU
    try:
        result["checks"] = run_checks(args, shape, device, dtype)
        result["overhead"] = bench_overhead(args, shape, device, dtype)
        result["forward"] = [] if args.skip_forward else bench_forward(args, shape, device, dtype)
    finally:
        torch.set_num_threads(threads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_tree_verify.json").write_text(json.dumps(result, indent=2))
    (args.out / "gpu_tree_verify.md").write_text(to_markdown(result))
    return result


if __name__ == "__main__":
    res = main()
    print(to_markdown(res))
    sys.exit(0 if all(c["passed"] is not False for c in res["checks"]) else 1)
