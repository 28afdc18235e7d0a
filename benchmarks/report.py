"""Figures of a benchmark run: paired speedups, acceptance, per-category, load, ablations.

Input is the list of job results (``benchmarks.harness.run_job``); output is plain dicts, one
per table row, which ``benchmarks.markdown`` renders and ``benchmarks.plots`` draws.

Definitions (design.md, section 5):

- tokens/s: output tokens / seconds. At concurrency 1 a prompt's seconds are its own request's
  (submit to finish, prefill included); under load, the loop's wall time.
- speedup: per prompt, tokens/s of the method / tokens/s of ``none`` on the same prompt in the
  same run; then mean, geometric mean, median, min and max over prompts.
- acceptance length: vLLM's figure, 1 + accepted / drafts (only steps that had a draft).
- tokens/pass: output tokens per target forward pass over all decoding steps (each pass
  commits 1 + accepted tokens), which also charges steps that drafted nothing.
- draft nodes/step: draft tokens / drafts; draft rate: drafts / passes (how often a request
  verified a draft at all: the adaptive budget may choose none).
- ms/pass (batch 1): seconds per target pass; step ms (load): wall time per engine step.
- TTFT: vLLM's own ``first_token_latency`` of each request (from its arrival in the engine
  to its first token: prefill, and under load the queue); batch 1: its p50 over prompts in
  ms, load: p50 and p99 in seconds. Prompt seeding's rows ride along with the prefill
  step's LM-head call, so TTFT is where they would show.
- With ``--repeats`` > 1 a prompt's seconds are the median over repeats, its counters the mean.
- tree share (RECAP methods, batch 1; from the proposer's own counters, ``StepDriver.stats``,
  taken per request): ``tree_share`` = tree verifications / drafted request-steps, where a
  tree verification is a request-step whose verified draft branched (``tree_requests``; a
  single path, whether chain mode or a tree cut to its first path, is not one) and a drafted
  request-step is one that verified at least one draft token (vLLM's ``drafts``); also
  ``tree_pass_share`` = tree verifications / target passes, ``tree_request_share`` = requests
  with at least one tree verification / requests, and ``off_chain_share`` = tree
  verifications whose accepted path left the tree's best chain / tree verifications.
- Sampling settings (``--sampling``, benchmarks.sampling): every table outside the sampling
  sections is ``greedy``; jobs are keyed by setting and paired against ``none`` under the
  same setting; for sampled settings token identity with ``none`` is not expected (n/a), but
  for RECAP's seeded requests in float32 (``benchmarks.report_sampling``).
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from benchmarks.methods import ABLATION_REFERENCE, ablation

COUNTER_KEYS = ("drafts", "draft_tokens", "accepted_tokens")
TREE_KEYS = ("tree_steps", "off_chain_accepts")  # RECAP's per-request tree counts (batch 1)
# Share of all CPUs used by other processes above which a measurement is flagged: on a 2-core
# machine 0.10 is a fifth of one core, already enough to stall the engine's 2-thread pool often.
CONTENDED = 0.10


# -- pure helpers ---------------------------------------------------------------------------

def speedup_stats(ratios: list[float]) -> dict:
    """mean, geometric mean, median, min and max of per-prompt speedups (None when empty)."""
    if not ratios:
        return dict.fromkeys(("speedup_mean", "speedup_geomean", "speedup_median", "speedup_min",
                              "speedup_max"))
    return {
        "speedup_mean": statistics.fmean(ratios),
        "speedup_geomean": math.exp(statistics.fmean(math.log(r) for r in ratios)),
        "speedup_median": statistics.median(ratios),
        "speedup_min": min(ratios),
        "speedup_max": max(ratios),
    }


def paired_speedups(method: dict[str, dict], baseline: dict[str, dict]) -> list[float]:
    """Per-prompt tokens/s ratios, method over baseline, for prompts both served with output.

    Args:
        method, baseline: prompt id -> record with ``output_ids`` and ``seconds``.
    """
    ratios = []
    for pid, rec in method.items():
        base = baseline.get(pid)
        if base is None or not rec["output_ids"] or not base["output_ids"]:
            continue
        if rec["seconds"] <= 0 or base["seconds"] <= 0:
            continue
        ratios.append((len(rec["output_ids"]) / rec["seconds"]) /
                      (len(base["output_ids"]) / base["seconds"]))
    return ratios


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (the shorter length if one is a prefix);
    None when identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def accepted_histogram(per_pos: list[int], drafts: int) -> list[int]:
    """Steps that accepted exactly k draft tokens, k = 0 .. len(per_pos).

    vLLM's ``spec_decode_num_accepted_tokens_per_pos[i]`` counts drafted steps whose accepted
    prefix reached position i, i.e. steps accepting >= i + 1 tokens; differences give the
    exact counts. Acceptance length of a step is k + 1.
    """
    at_least = [drafts, *per_pos, 0]
    hist = [at_least[k] - at_least[k + 1] for k in range(len(per_pos) + 1)]
    if any(h < 0 for h in hist):
        raise ValueError(f"per-position counts {per_pos} are not non-increasing within {drafts} drafts")
    return hist


def percentile(values: list[float], q: float) -> float | None:
    """q-th percentile (numpy's linear interpolation), None for no values."""
    return float(np.percentile(values, q)) if values else None


def _ttfts(recs: Iterable[dict]) -> list[float]:
    """The records' seconds to the first token, where known."""
    return [r["ttft_s"] for r in recs if r.get("ttft_s") is not None]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


# -- merging repeats ------------------------------------------------------------------------

def merge_requests(jobs: list[dict]) -> dict[str, dict]:
    """Prompt id -> one record over repeats of the same (method, phase, concurrency).

    seconds and ttft_s (seconds to the first token): medians over repeats; counters: mean;
    output_ids: the first repeat's, with ``consistent`` False if a repeat produced different
    tokens.
    """
    grouped: dict[str, list[dict]] = defaultdict(list)
    for job in jobs:
        for rec in job.get("requests", []):
            grouped[rec["prompt_id"]].append(rec)
    out = {}
    for pid, recs in grouped.items():
        first = recs[0]
        merged = {k: v for k, v in first.items() if k not in ("seconds", *COUNTER_KEYS, *TREE_KEYS)}
        merged["seconds"] = statistics.median(r["seconds"] for r in recs)
        merged["seconds_all"] = [r["seconds"] for r in recs]
        firsts = _ttfts(recs)
        merged["ttft_s"] = statistics.median(firsts) if firsts else None
        for key in (*COUNTER_KEYS, *TREE_KEYS):
            if key in first:
                merged[key] = statistics.fmean(r.get(key, 0) for r in recs)
        merged["consistent"] = all(r["output_ids"] == first["output_ids"] for r in recs)
        shares = [r["foreign_cpu"] for r in recs if r.get("foreign_cpu") is not None]
        merged["foreign_cpu"] = statistics.median(shares) if shares else None
        out[pid] = merged
    return out


def merged_counters(jobs: list[dict]) -> dict:
    """Job-level counter deltas summed over repeats (per-position vectors element-wise)."""
    total = {**dict.fromkeys(COUNTER_KEYS, 0), "accepted_per_pos": [], "preemptions": 0}
    for job in jobs:
        c = job.get("counters") or {}
        for key in (*COUNTER_KEYS, "preemptions"):
            total[key] += c.get(key, 0)
        vec = c.get("accepted_per_pos", [])
        acc = total["accepted_per_pos"]
        total["accepted_per_pos"] = [(acc[i] if i < len(acc) else 0) + (vec[i] if i < len(vec) else 0)
                                     for i in range(max(len(acc), len(vec)))]
    return total


# -- figures --------------------------------------------------------------------------------

def prompt_figures(recs: dict[str, dict], baseline: dict[str, dict] | None) -> dict:
    """Figures of one method over a set of prompts (records from ``merge_requests``)."""
    tokens = sum(len(r["output_ids"]) for r in recs.values())
    seconds = sum(r["seconds"] for r in recs.values())
    drafts = sum(r.get("drafts", 0) for r in recs.values())
    accepted = sum(r.get("accepted_tokens", 0) for r in recs.values())
    draft_tokens = sum(r.get("draft_tokens", 0) for r in recs.values())
    passes = tokens - accepted
    out = {
        "prompts": len(recs),
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else None,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "tokens_per_pass": tokens / passes if passes > 0 else None,
        "draft_tokens_per_step": draft_tokens / drafts if drafts else None,
        "draft_rate": drafts / passes if passes > 0 else None,
        # cost of one target pass including drafting: separates "fewer passes" from "dearer
        # passes", and shows machine drift between jobs (none's ms/pass is its ms/token)
        "ms_per_pass": 1000 * seconds / passes if passes > 0 else None,
        # prefill and the first step (prompt seeding's rows ride along with it)
        "ttft_p50_ms": _ms(percentile(_ttfts(recs.values()), 50)),
        "consistent_repeats": all(r.get("consistent", True) for r in recs.values()),
        "foreign_cpu": max((r["foreign_cpu"] for r in recs.values() if r.get("foreign_cpu") is not None),
                           default=None),
    }
    out.update(tree_figures(recs, drafts, passes))
    if baseline is not None:
        common = [pid for pid in recs if pid in baseline]
        diffs = {pid: first_difference(recs[pid]["output_ids"], baseline[pid]["output_ids"])
                 for pid in common}
        out["identical"] = sum(d is None for d in diffs.values())
        out["compared"] = len(common)
        out["first_differences"] = {pid: d for pid, d in diffs.items() if d is not None}
        out.update(speedup_stats(paired_speedups(recs, baseline)))
    return out


def tree_figures(recs: dict[str, dict], drafts: float, passes: float) -> dict:
    """RECAP's tree share over a set of prompts (see the module's definitions); empty when no
    record carries tree counts (not RECAP, or not batch 1)."""
    with_counts = [r for r in recs.values() if "tree_steps" in r]
    if not with_counts:
        return {}
    trees = sum(r["tree_steps"] for r in with_counts)
    off_chain = sum(r.get("off_chain_accepts", 0) for r in with_counts)
    requests = sum(r["tree_steps"] > 0 for r in with_counts)
    return {
        "tree_steps": trees,
        "tree_share": trees / drafts if drafts else None,
        "tree_pass_share": trees / passes if passes > 0 else None,
        "requests_with_trees": requests,
        "tree_request_share": requests / len(with_counts),
        "off_chain_share": off_chain / trees if trees else None,
    }


def _jobs(results: list[dict], method: str, phase: str, concurrency: int = 1,
          sampling: str = "greedy") -> list[dict]:
    """A method's jobs of one phase, concurrency and sampling setting (results without a
    setting are greedy: older runs)."""
    return [r for r in results if r["method"] == method and r["phase"] == phase
            and r["concurrency"] == concurrency and r.get("sampling", "greedy") == sampling]


def _ok(jobs: list[dict]) -> list[dict]:
    return [j for j in jobs if not j.get("error")]


def error_line(jobs: list[dict]) -> str | None:
    """Last line of the first error among jobs (the exception), None if all succeeded."""
    for j in jobs:
        if j.get("error"):
            lines = [ln for ln in j["error"].strip().splitlines() if ln.strip()]
            return lines[-1][:200] if lines else "error"
    return None


def phase_rows(results: list[dict], methods: list[str], phase: str,
               group_by: str | None = None, sampling: str = "greedy",
               identity: bool = True) -> list[dict]:
    """One row per method (per group value too, with ``group_by`` = a record field such as
    ``category`` or ``turn``) of a batch-1 phase under one sampling setting, paired against
    ``none`` under the same setting. ``identity=False`` (sampled settings): no token identity
    check; ``identical`` is None and ``identity`` says "n/a"."""
    baseline = merge_requests(_ok(_jobs(results, "none", phase, 1, sampling)))
    rows = []
    for method in methods:
        jobs = _jobs(results, method, phase, 1, sampling)
        if not jobs:
            continue
        recs = merge_requests(_ok(jobs))
        base = baseline if baseline and method != "none" else None
        groups = list(dict.fromkeys(r[group_by] for r in recs.values())) if group_by else [None]
        for g in groups:
            sub = {pid: r for pid, r in recs.items() if g is None or r[group_by] == g}
            row = {"method": method, **prompt_figures(sub, base), "error": error_line(jobs)}
            if not identity and base is not None:
                row.update(identical=None, compared=None, first_differences={}, identity="n/a")
            if group_by:
                row[group_by] = g
            if g is None:
                row.update(_job_extras(_ok(jobs)))
            rows.append(row)
    return rows


def _job_extras(jobs: list[dict]) -> dict:
    """Proposer cost, RECAP internals, peak RSS and the acceptance histogram of a method's jobs."""
    if not jobs:
        return {}
    counters = merged_counters(jobs)
    proposer = jobs[0].get("proposer") or {}
    step_us = proposer.get("step_us") or {}
    out = {
        "peak_rss_mb": max(j.get("peak_rss_mb", 0) for j in jobs),
        "proposer_kind": proposer.get("kind"),
        "proposer_p50_us": step_us.get("p50"),
        "proposer_p99_us": step_us.get("p99"),
        "proposer_steps": step_us.get("n"),
        "accepted_histogram": (accepted_histogram(counters["accepted_per_pos"], counters["drafts"])
                               if counters["drafts"] else []),
        "engine_start_s": statistics.fmean(j.get("engine_start_s", 0) for j in jobs),
    }
    if proposer.get("kind") == "recap":
        tree, mem = proposer.get("tree", {}), proposer.get("memory_peak", {})
        out.update(tree_mean_nodes=tree.get("mean_nodes"),
                   per_depth_acceptance=tree.get("per_depth_acceptance"),
                   u_bytes=max(mem.get("u_bytes", 0), proposer.get("memory_end", {}).get("u_bytes", 0)),
                   context_rows_peak=mem.get("context_rows"), context_bytes_peak=mem.get("context_bytes"),
                   live_requests_peak=mem.get("requests"))
    return out


def load_rows(results: list[dict], methods: list[str], concurrencies: list[int]) -> list[dict]:
    """Method x concurrency: tokens/s, ratio vs ``none`` at the same concurrency, latency.

    Concurrency 1 is the batch-1 Spec-Bench run (the closed loop with one request in flight);
    higher concurrency comes from its own fresh engine per method.
    """
    rows = []
    for c in concurrencies:
        per_method = {}
        for method in methods:
            jobs = _jobs(results, method, "spec_bench", c)
            if not jobs:
                continue
            ok = _ok(jobs)
            recs = merge_requests(ok)
            tokens = sum(len(r["output_ids"]) for r in recs.values())
            if c == 1:
                seconds = sum(r["seconds"] for r in recs.values())
            else:
                walls = [j["loop"]["wall_s"] for j in ok if j.get("loop")]
                seconds = statistics.median(walls) if walls else 0.0
            counters = merged_counters(ok)
            passes = tokens * max(1, len(ok)) - counters["accepted_tokens"]
            latencies = [r["seconds"] for r in recs.values()]
            firsts = _ttfts(recs.values())
            steps = statistics.fmean((j.get("loop") or {}).get("steps", 0) for j in ok) if ok else 0
            step_us = ((ok[0].get("proposer") or {}).get("step_us") or {}) if ok else {}
            per_method[method] = (recs, {
                "method": method, "concurrency": c, "prompts": len(recs),
                "output_tokens": tokens, "seconds": seconds,
                "tokens_per_s": tokens / seconds if seconds else None,
                "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
                "ttft_p50_s": percentile(firsts, 50), "ttft_p99_s": percentile(firsts, 99),
                "acceptance_length": (1 + counters["accepted_tokens"] / counters["drafts"]
                                      if counters["drafts"] else None),
                "tokens_per_pass": tokens * max(1, len(ok)) / passes if passes > 0 else None,
                "draft_tokens_per_step": (counters["draft_tokens"] / counters["drafts"]
                                          if counters["drafts"] else None),
                "draft_rate": counters["drafts"] / passes if passes > 0 else None,
                "step_ms": 1000 * seconds / steps if steps else None,
                "max_in_flight": max((j.get("loop") or {}).get("max_in_flight", 0) for j in ok) if ok else None,
                "preemptions": counters["preemptions"],
                "proposer_p50_us": step_us.get("p50"),
                "peak_rss_mb": max((j.get("peak_rss_mb", 0) for j in ok), default=None),
                "foreign_cpu": max((j["foreign_cpu"] for j in ok if j.get("foreign_cpu") is not None),
                                   default=None),
                "error": error_line(jobs),
            })
        base = per_method.get("none")
        for method, (recs, row) in per_method.items():
            if base is not None and method != "none":
                brecs, brow = base
                if row["tokens_per_s"] and brow["tokens_per_s"]:
                    row["vs_none"] = row["tokens_per_s"] / brow["tokens_per_s"]
                common = [p for p in recs if p in brecs]
                row["identical"] = sum(recs[p]["output_ids"] == brecs[p]["output_ids"] for p in common)
                row["compared"] = len(common)
            rows.append(row)
    return rows


def ablation_rows(results: list[dict], names: list[str]) -> list[dict]:
    """The full configuration at the ablation budget, then each variant relative to it."""
    overall = {r["method"]: r for r in phase_rows(results, [ABLATION_REFERENCE, *names], "spec_bench")}
    full = overall.get(ABLATION_REFERENCE)
    full_recs = merge_requests(_ok(_jobs(results, ABLATION_REFERENCE, "spec_bench")))
    rows = []
    for name in [ABLATION_REFERENCE, *names]:
        row = overall.get(name)
        if row is None:
            continue
        info = ablation(name)
        out = {"method": name, "variant": info.paper_row if info else "full RECAP (reference)",
               "paper_full_better_by": info.paper_gain if info else None,
               **{k: row.get(k) for k in ("prompts", "tokens_per_s", "acceptance_length",
                                          "tokens_per_pass", "draft_tokens_per_step",
                                          "speedup_geomean", "identical", "compared", "error")}}
        if info and full is not None:
            if row.get("acceptance_length") and full.get("acceptance_length"):
                out["full_vs_variant_accept"] = full["acceptance_length"] / row["acceptance_length"] - 1
            ratios = paired_speedups(full_recs, merge_requests(_ok(_jobs(results, name, "spec_bench"))))
            if ratios:
                out["full_vs_variant_tps"] = speedup_stats(ratios)["speedup_geomean"] - 1
        rows.append(out)
    return rows


def findings(summary: dict) -> list[str]:
    """Plain statements a reader must not miss: contended measurements, crashes, non-identical
    outputs, RECAP (or any method) slower than no speculation under load, preemptions."""
    out = list(summary.get("contended_jobs", []))
    for table in ("overall", "two_turn", "multimodal", "ablations"):
        for row in summary.get(table, []):
            out += _row_findings(table, row)
    for section in summary.get("sampling", []):
        if section["name"] != "greedy":  # greedy's rows are the overall table's
            for row in section["rows"]:
                out += _row_findings(f"sampling {section['name']}", row)
        out += section.get("notes", [])
    for row in summary.get("load", []):
        if row.get("error"):
            out.append(f"load c={row['concurrency']}: {row['method']} failed: {row['error']}")
            continue
        if row.get("vs_none") is not None and row["vs_none"] < 1.0:
            where = "batch 1" if row["concurrency"] == 1 else f"{row['concurrency']} in flight"
            noise = " (within this machine's ~10% noise)" if row["vs_none"] >= 0.9 else ""
            out.append(f"load c={row['concurrency']}: {row['method']} at {row['vs_none']:.2f}x the "
                       f"tokens/s of none ({row['tokens_per_s']:.1f} vs "
                       f"{row['tokens_per_s'] / row['vs_none']:.1f}, {where}) - slower than no "
                       f"speculation{noise}")
        if row.get("compared") and row["identical"] < row["compared"]:
            out.append(f"load c={row['concurrency']}: {row['method']} output differs from none at "
                       f"the same concurrency on {row['compared'] - row['identical']} of "
                       f"{row['compared']} prompts")
        if row.get("preemptions"):
            out.append(f"load c={row['concurrency']}: {row['method']} had {row['preemptions']} "
                       f"preemptions (KV cache too small; raise --kv-cache-mib)")
    return out


def _row_findings(table: str, row: dict) -> list[str]:
    """A batch-1 row's failure, differences from ``none`` (where identity is expected) and
    repeats that disagree."""
    out = []
    label = f"{row['method']}" + (f" turn {row['turn']}" if row.get("turn") else "")
    if row.get("error"):
        out.append(f"{table}: {label} failed: {row['error']}")
    elif row.get("compared") and row.get("identical") is not None and row["identical"] < row["compared"]:
        where = row.get("first_differences") or {}
        detail = ", ".join(f"{pid} at token {pos}" for pid, pos in list(where.items())[:5])
        out.append(f"{table}: {label} output differs from none on "
                   f"{row['compared'] - row['identical']} of {row['compared']} prompts ({detail})")
    if row.get("consistent_repeats") is False:
        out.append(f"{table}: {label} produced different tokens in different repeats")
    return out


def build_summary(results: list[dict], methods: list[str], concurrencies: list[int],
                  ablations: list[str], mm_methods: list[str], load_methods: list[str] | None = None,
                  two_turn_methods: list[str] | None = None, sampling: list[str] | None = None,
                  sampling_methods: list[str] | None = None, sampling_seed: int = 0,
                  dtype: str | None = None) -> dict:
    """Every table of the report as lists of row dicts (see benchmarks.markdown).

    ``sampling``: the run's setting names; anything besides ``greedy`` adds ``sampling`` (one
    section per setting, benchmarks.report_sampling) and ``sampling_targets``.
    """
    load_methods = list(dict.fromkeys(methods + (load_methods or [])))
    summary = {
        "overall": phase_rows(results, methods, "spec_bench"),
        "per_category": phase_rows(results, methods, "spec_bench", group_by="category"),
        "load": load_rows(results, load_methods, concurrencies),
        "two_turn": phase_rows(results, two_turn_methods or methods, "two_turn", group_by="turn"),
        "multimodal": phase_rows(results, mm_methods, "multimodal"),
        "ablations": ablation_rows(results, ablations) if ablations else [],
    }
    if sampling and sampling != ["greedy"]:
        from benchmarks import report_sampling  # imports this module

        summary["sampling"] = report_sampling.sections(results, sampling, sampling_methods or methods,
                                                       sampling_seed, dtype)
        summary["sampling_targets"] = report_sampling.targets(summary["sampling"])
    from benchmarks import precision  # imports this module

    summary["fp32_recheck"] = precision.recheck_rows(results)
    summary["contended_jobs"] = contended(results)
    summary["findings"] = findings(summary) + precision.findings(summary["fp32_recheck"])
    return summary


def contended(results: list[dict]) -> list[str]:
    """One line per job measured while other processes took more than CONTENDED of the CPUs."""
    out = []
    for job in results:
        share = job.get("foreign_cpu")
        if share is None or share <= CONTENDED:
            continue
        hit = [f"{r['prompt_id']} {100 * r['foreign_cpu']:.0f}%" for r in job.get("requests", [])
               if (r.get("foreign_cpu") or 0) > CONTENDED]
        load = job.get("load_average_start", [None])[0], job.get("load_average_end", [None])[0]
        out.append(f"{job['name']}: other processes used {100 * share:.0f}% of the CPUs during the "
                   f"measurement (load average {load[0]:.1f} -> {load[1]:.1f})"
                   + (f"; prompts: {', '.join(hit)}" if hit else "")
                   + " - its timings (and speedups paired with it) are unreliable; rerun, or use --repeats")
    return out
