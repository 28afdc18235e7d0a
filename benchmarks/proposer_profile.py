"""RECAP's own work per engine step, split by function, on Spec-Bench prompts (batch 1, or
``--concurrency C`` prompts per call).

    python -m benchmarks.proposer_profile                       # default tree, 13 prompts x 64
    python -m benchmarks.proposer_profile --spec '{"method": "recap", "budget_policy": "fixed",
        "node_budget": 8}' --prompts 8                           # same steps for two codes
    python -m benchmarks.proposer_profile --sampling qwen_text    # seeded per prompt, as
                                                                 # benchmarks.run (-1: not)
    python -m benchmarks.proposer_profile --model gemma3          # 262k vocabulary
    python -m benchmarks.proposer_profile --prompts 26 --concurrency 4   # under load
    python -m benchmarks.proposer_profile --layers   # + a tree step's attention layer vs a
                                                     # stock one of the same query rows

Prints the p50 / mean / p99 of ``RecapProposer.step_seconds`` (what ``benchmarks.run`` reports
as proposer cost) and, per timed driver function, its p50 / mean / total. The timers add ~1 us
per call. To compare two codes, run this from each checkout in turn on the same prompts (the
adaptive budget drafts on different steps from run to run, so pin a fixed budget with
``--spec``); the host's load moves every figure, so alternate the runs.

``--again`` runs each pure piece a second time right after the first and times both ("<name>
again"): the forward pass streams the model's weights through the caches, so the first call
finds the interpreter's and RECAP's code and data evicted, the second finds them warm; the
gap is the cost of running this work after a forward pass rather than the work itself (the
step figures then include the repeats: use them only without ``--again``).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine runs in this process

# Driver methods (attribute paths from the StepDriver) and module functions the driver calls.
METHODS = ("_advance", "_draft", "budget.choose", "budget.observe_tree", "drafter.propose",
           "drafter.observe", "drafter.commit", "seeder.plan")
FUNCTIONS = ("topk_rows", "node_tokens_of_rows", "prepare_trees", "write_trees", "compact_kv",
             "build_plan", "rewrite_positions", "tree_output")
# Pure functions (no state, inputs unchanged): ``--again`` runs each a second time at once
PURE = ("topk_rows", "node_tokens_of_rows", "tree_output", "build_plan")


class StepCounter:
    """Counts the driver's finished steps, so each timed call is booked to its step (the
    clock appends one ``work_seconds`` entry per finished step, in the same order)."""

    def __init__(self) -> None:
        self.step = 0

    def wrap(self, step_finished):
        def counted(*args, **kwargs):
            try:
                return step_finished(*args, **kwargs)
            finally:
                self.step += 1
        return counted


def _timed(fn, times: list[float], again: list[float] | None = None,
           steps: list[int] | None = None, counter: StepCounter | None = None):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t)
            if steps is not None:
                steps.append(counter.step)
            if again is not None:  # the same call on warm caches
                t = time.perf_counter()
                fn(*args, **kwargs)
                again.append(time.perf_counter() - t)
    return wrapper


def instrument(driver, again: bool = False, steps: dict[str, list[int]] | None = None,
               counter: StepCounter | None = None) -> dict[str, list[float]]:
    """Wraps the driver's timed pieces in place; returns name -> seconds per call. With
    ``again``, each of ``PURE`` also runs a second time right after its first, timed as
    ``"<name> again"``. With ``steps`` and ``counter``, ``steps[name]`` gets the step of each
    call (``counter`` wraps the driver's clock to count them)."""
    from vllm_recap.vllm import driver as driver_module

    times: dict[str, list[float]] = collections.defaultdict(list)
    if steps is not None:
        driver.clock.step_finished = counter.wrap(driver.clock.step_finished)

    def booked(name: str) -> dict:
        return {} if steps is None else {"steps": steps[name], "counter": counter}

    for path in METHODS:
        *parents, name = path.split(".")
        obj = driver
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, name, _timed(getattr(obj, name), times[path], **booked(path)))
    for name in FUNCTIONS:
        repeat = times[f"{name} again"] if again and name in PURE else None
        setattr(driver_module, name, _timed(getattr(driver_module, name), times[name], repeat,
                                            **booked(name)))
    return times


def slow_step_pieces(times: dict[str, list[float]], steps: dict[str, list[int]],
                     slow: set[int]) -> dict[str, float]:
    """Per piece, its seconds per step over the ``slow`` steps (indices as ``steps``), the
    largest first; pieces absent from those steps left out."""
    if not slow:
        return {}
    spent = {name: sum(t for t, k in zip(times[name], steps.get(name, ())) if k in slow)
             for name in times}
    return {name: total / len(slow)
            for name, total in sorted(spent.items(), key=lambda kv: -kv[1]) if total > 0}


@contextlib.contextmanager
def attention_layers_timed(impl_cls) -> Iterator[dict[str, dict[int, list[float]]]]:
    """While open, ``impl_cls.forward`` (the class attribute: every layer) times each
    attention layer call of the forward pass, by path and query rows: "tree" (a step with a
    tree: the path-split kernel call, its scratch copies and writes, the K/V stash) or
    "stock" (vLLM's own forward: plain steps and chains). Yields path -> rows -> seconds per
    call; the original forward is back on exit."""
    times: dict[str, dict[int, list[float]]] = {"tree": collections.defaultdict(list),
                                                "stock": collections.defaultdict(list)}
    original = impl_cls.forward

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        path = "stock" if self.tree_step(attn_metadata) is None else "tree"
        t = time.perf_counter()
        try:
            return original(self, layer, query, key, value, kv_cache, attn_metadata, *args,
                            **kwargs)
        finally:
            times[path][int(query.shape[0])].append(time.perf_counter() - t)

    impl_cls.forward = forward
    try:
        yield times
    finally:
        impl_cls.forward = original


def layer_table(times: dict[str, dict[int, list[float]]], least: int = 30) -> list[dict]:
    """Per query-row count with at least ``least`` timed calls of both paths: the p50 of a
    tree layer and of a stock layer (us) and their ratio, most tree calls first."""
    rows = []
    for n, tree in times["tree"].items():
        stock = times["stock"].get(n, [])
        if len(tree) >= least and len(stock) >= least:
            t, s = statistics.median(tree) * 1e6, statistics.median(stock) * 1e6
            rows.append({"rows": n, "tree_calls": len(tree), "tree_p50_us": t,
                         "stock_calls": len(stock), "stock_p50_us": s, "ratio": t / s})
    return sorted(rows, key=lambda r: -r["tree_calls"])


def request_params(sampling: str, base_seed: int, prompt_ids: list[str],
                   max_new_tokens: int) -> list:
    """[P] ``SamplingParams`` per prompt: the setting, ``max_new_tokens`` with EOS ignored, and
    for a sampled setting the fixed seed ``benchmarks.run`` gives the same prompt
    (:func:`~benchmarks.sampling.request_seed`; none with ``base_seed`` -1)."""
    from benchmarks.sampling import job_sampling, sampling_params

    setting = job_sampling(sampling, base_seed)
    return [sampling_params(setting, max_new_tokens, True, pid) for pid in prompt_ids]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default='{"method": "recap"}', help="speculative_config (JSON)")
    ap.add_argument("--model", default="smollm2",
                    help="smollm2 | gemma3 (the embedded models) | a local HF folder")
    ap.add_argument("--prompts", type=int, default=13,
                    help="Spec-Bench prompts: the first N of ceil(N / 13) per category, in the "
                         "file's category order (13: one per category, 26: two)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=1,
                    help="prompts per generate call (default 1: batch 1)")
    ap.add_argument("--sampling", default="greedy", help="a setting of benchmarks/sampling.py")
    ap.add_argument("--sampling-seed", type=int, default=0,
                    help="base of the fixed per-request seeds of sampled settings, as "
                         "benchmarks.run (a seeded sampled request takes RECAP's seeded path: "
                         "its rows drawn with vLLM's seeds, every drafted step verified by "
                         "RECAP); -1: unseeded (default: 0)")
    ap.add_argument("--dtype", default="auto",
                    help="auto = bfloat16 if the CPU has AVX-512 BF16, else float32 (as "
                         "benchmarks.run); or any vLLM dtype (default: auto)")
    ap.add_argument("--again", action="store_true",
                    help="run the pure pieces (%s) twice per call and time both: after the "
                         "forward pass the first call runs on cold caches" % ", ".join(PURE))
    ap.add_argument("--layers", action="store_true",
                    help="also time every attention layer call of the forward (CPU): a tree "
                         "step's layer against a stock one (plain and chain steps) of the same "
                         "query rows -- the fixed cost of RECAP's tree path per layer")
    ap.add_argument("--out", default=None,
                    help="also write the figures to this JSON file (what is printed, as numbers)")
    args = ap.parse_args(argv)
    if args.concurrency < 1:
        ap.error(f"--concurrency must be at least 1, got {args.concurrency}")
    from benchmarks.machine import resolve_dtype

    args.dtype = resolve_dtype(args.dtype)

    import numpy as np
    from vllm import LLM, TokensPrompt

    from benchmarks.harness import model_runner
    from benchmarks.machine import cpu_line
    from benchmarks.workloads import first_spec_bench_prompts
    from vllm_recap.models import resolve_model
    from vllm_recap.models.engine import engine_kwargs, shutdown_llm

    llm = LLM(**engine_kwargs(resolve_model(args.model), dtype=args.dtype,
                              speculative_config=json.loads(args.spec)))
    bench = first_spec_bench_prompts(llm.get_tokenizer(), args.prompts)
    prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in bench]
    params = request_params(args.sampling, args.sampling_seed, [p.prompt_id for p in bench],
                            args.max_new_tokens)
    seeded = any(p.seed is not None for p in params)
    proposer = model_runner(llm).drafter
    call_steps: dict[str, list[int]] = collections.defaultdict(list)  # each call's step
    counter = StepCounter()
    times = instrument(proposer.recap_hooks, args.again, call_steps, counter)
    with contextlib.ExitStack() as stack:
        layer_times = None
        if args.layers:
            from vllm_recap.vllm.cpu_backend import RecapCPUAttentionImpl

            layer_times = stack.enter_context(attention_layers_timed(RecapCPUAttentionImpl))
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        proposer.reset_figures()
        for v in [*times.values(), *call_steps.values(), *(layer_times or {}).values()]:
            v.clear()
        counter.step = 0  # as the clock's figures, cleared above
        t0 = time.perf_counter()
        for start in range(0, len(prompts), args.concurrency):  # default: batch 1
            llm.generate(prompts[start:start + args.concurrency],
                         params[start:start + args.concurrency], use_tqdm=False)
        wall = time.perf_counter() - t0
    steps = np.asarray(proposer.step_seconds) * 1e3
    seeding = np.asarray(proposer.seeding_seconds) * 1e3
    machine = cpu_line()
    quantiles = (("p50", np.median), ("mean", np.mean), ("p99", lambda a: np.percentile(a, 99)))
    work = {q: float(f(steps)) for q, f in quantiles}
    # What the slow steps are: the work with prompt seeding taken out, and how many of the
    # steps at or above the p99 computed prompt rows (seeding > 0.5 ms: every step pays a few
    # us to plan none)
    unseeded = {q: float(f(steps - seeding)) for q, f in quantiles}
    slow = steps >= work["p99"]
    seeded_slow = int(np.count_nonzero(slow & (seeding > 0.5)))
    # what the slow steps spent their time on (the clock keeps the last 4096 steps: the
    # indices match the counter's while the run has no more)
    slow_pieces = (slow_step_pieces(times, call_steps, set(np.flatnonzero(slow).tolist()))
                   if counter.step == len(steps) else {})
    pieces = {name: {"calls": len(v), "p50_ms": float(np.median(v) * 1e3),
                     "mean_ms": float(np.mean(v) * 1e3), "total_ms": float(np.sum(v) * 1e3)}
              for name, v in sorted(times.items(), key=lambda kv: -sum(kv[1])) if v}
    print(f"{machine}, {args.model}, dtype {args.dtype}, sampling {args.sampling}"
          f"{' (seeded)' if seeded else ''}, spec {args.spec}, concurrency {args.concurrency}")
    print(f"wall {wall:.1f} s, {len(steps)} steps; RECAP work per step: p50 "
          f"{work['p50']:.3f} ms, mean {work['mean']:.3f} ms, p99 {work['p99']:.3f} ms")
    print(f"  without prompt seeding: p50 {unseeded['p50']:.3f} ms, mean "
          f"{unseeded['mean']:.3f} ms, p99 {unseeded['p99']:.3f} ms; steps at or above the p99 "
          f"that seeded prompt rows: {seeded_slow} of {int(np.count_nonzero(slow))}")
    if slow_pieces:
        print("  their largest pieces, ms per step: " + ", ".join(
            f"{name} {seconds * 1e3:.3f}" for name, seconds in list(slow_pieces.items())[:6]))
    for name, p in pieces.items():
        print(f"  {name:24s} calls {p['calls']:6d}  p50 {p['p50_ms']:.3f}  mean "
              f"{p['mean_ms']:.3f}  total {p['total_ms']:.0f} ms")
    layers, layer_calls = None, None
    if layer_times is not None:
        layer_calls = {path: sum(map(len, by_rows.values()))
                       for path, by_rows in layer_times.items()}
        layers = layer_table(layer_times)
        print("  attention layer calls, tree step against stock (plain / chain) step, same "
              "query rows:")
        for r in layers:
            print(f"    {r['rows']:4d} rows  tree p50 {r['tree_p50_us']:6.1f} us "
                  f"({r['tree_calls']} calls)  stock p50 {r['stock_p50_us']:6.1f} us "
                  f"({r['stock_calls']} calls)  tree / stock {r['ratio']:.2f}")
        if not layers:
            print("    (no row count with 30 calls of both)")
    if args.out:
        import vllm_recap

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine, "model": args.model,
            "dtype": args.dtype,
            "sampling": args.sampling, "seeded": seeded, "spec": json.loads(args.spec),
            "prompts": len(prompts),
            "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens,
            "vllm_recap": str(Path(vllm_recap.__file__).parent), "wall_s": wall,
            "steps": len(steps),
            "work_ms": work, "work_without_seeding_ms": unseeded,
            "p99_steps": {"steps": int(np.count_nonzero(slow)), "seeded": seeded_slow,
                          "pieces_ms": {k: v * 1e3 for k, v in slow_pieces.items()}},
            "pieces": pieces, "attention_layers": layers,
            "attention_layer_calls": layer_calls}, indent=1))
    shutdown_llm(llm)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
