"""Float32 recheck of greedy prompts whose output differed from ``none`` in a bfloat16 run.

In bfloat16 a verification pass over several tokens reduces its sums in another order than a
one-token decoding pass, and the rounding of bf16 is coarse enough that two candidate tokens
within rounding of each other can swap: any speculative method (vLLM's ngram and suffix
decoding too) then continues with another, equally valid, greedy answer. That is numerics,
not a verification bug, and the way to tell the two apart is to rerun exactly those prompts in
float32, where the same methods must be token-identical to no speculation. This module picks
the prompts, builds the recheck jobs, and turns their results into the report's rows.
"""
from __future__ import annotations

from collections.abc import Callable

from benchmarks import report

PHASE = "fp32_recheck"

STATEMENT = (
    "In bfloat16, verifying several tokens in one pass rounds differently from decoding one "
    "token per pass, so any speculative method (vLLM's ngram and suffix decoding included) can "
    "pick another token where two candidates are within bf16 rounding of each other, and "
    "continue with another greedy answer from there. Every batch-1 prompt whose output "
    "differed from `none` was rerun in float32 below, for `none` and for each method it "
    "differed under: identical there means the bf16 difference was rounding.")


def differing_prompts(results: list[dict], methods: list[str]) -> dict[str, list[str]]:
    """Method -> prompt ids whose greedy batch-1 Spec-Bench output differs from none's."""
    baseline = report.merge_requests(report._ok(report._jobs(results, "none", "spec_bench")))
    out: dict[str, list[str]] = {}
    for method in methods:
        if method == "none":
            continue
        recs = report.merge_requests(report._ok(report._jobs(results, method, "spec_bench")))
        diff = [pid for pid in recs if pid in baseline
                and recs[pid]["output_ids"] != baseline[pid]["output_ids"]]
        if diff:
            out[method] = diff
    return out


def recheck_jobs(results: list[dict], methods: list[str], prompts: list[dict],
                 make_job: Callable[..., dict], engine: dict) -> list[dict]:
    """float32 jobs: ``none`` on every differing prompt, each method on its own ones.

    Args:
        results: the run's job results so far.
        methods: the batch-1 methods of the run.
        prompts: the run's prompt dicts (``prompt_id`` keyed).
        make_job: ``Plan._job``-like factory (method, phase, concurrency, repeat, prompts=...).
        engine: the run's engine kwargs; the jobs use them with ``dtype="float32"``.
    """
    differing = differing_prompts(results, methods)
    if not differing:
        return []
    by_id = {p["prompt_id"]: p for p in prompts}
    union = [pid for pid in by_id if any(pid in ids for ids in differing.values())]
    jobs = [make_job("none", PHASE, 1, 0, prompts=[by_id[p] for p in union])]
    jobs += [make_job(m, PHASE, 1, 0, prompts=[by_id[p] for p in ids])
             for m, ids in differing.items()]
    return [{**job, "engine": {**engine, "dtype": "float32"}} for job in jobs]


def recheck_rows(results: list[dict]) -> list[dict]:
    """One row per rechecked method: prompts that differed in bf16, and how many of them are
    identical to none in float32 (with the first differing token of any that are not)."""
    baseline = report.merge_requests(report._ok(report._jobs(results, "none", PHASE)))
    rows = []
    methods = dict.fromkeys(r["method"] for r in results if r["phase"] == PHASE)
    for method in methods:
        if method == "none":
            continue
        jobs = report._jobs(results, method, PHASE)
        recs = report.merge_requests(report._ok(jobs))
        still = {pid: report.first_difference(recs[pid]["output_ids"], baseline[pid]["output_ids"])
                 for pid in recs if pid in baseline}
        rows.append({
            "method": method,
            "rechecked": len(still),
            "identical_fp32": sum(d is None for d in still.values()),
            "prompts": ", ".join(sorted(still)),
            "still_different": ", ".join(f"{p} at token {d}" for p, d in still.items()
                                         if d is not None) or "-",
            "error": report.error_line(jobs) or report.error_line(report._jobs(results, "none", PHASE)),
        })
    return rows


def findings(rows: list[dict]) -> list[str]:
    """One line for the methods whose bf16 differences were all identical in float32, and one
    per method whose recheck was not fully identical, or failed."""
    clean = [r for r in rows if not r["error"] and r["identical_fp32"] == r["rechecked"]]
    out = []
    if clean:
        out.append("float32 recheck: the bf16 differences above are rounding -- identical to none "
                   "in float32: " + ", ".join(f"{r['method']} {r['identical_fp32']}/{r['rechecked']}"
                                              for r in clean))
    for row in rows:
        if row["error"]:
            out.append(f"float32 recheck of {row['method']} failed: {row['error']}")
        elif row["identical_fp32"] < row["rechecked"]:
            out.append(f"float32 recheck: {row['method']} still differs from none on "
                       f"{row['rechecked'] - row['identical_fp32']} of {row['rechecked']} prompts "
                       f"({row['still_different']}) - not explained by bf16 rounding")
    return out
