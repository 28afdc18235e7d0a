"""Summaries of benchmark runs: per-method figures, paired speedups, markdown tables."""
from __future__ import annotations

import math
import statistics

from benchmarks.harness import MethodRun


def summarize(run: MethodRun, baseline: MethodRun | None) -> dict:
    """Figures for one method over its prompts (paired per prompt against ``baseline``).

    - ``tokens_per_s``: total output tokens / total generation seconds.
    - ``acceptance_length``: vLLM's "mean acceptance length" = 1 + accepted / drafts
      (counts only steps that had a draft).
    - ``tokens_per_pass``: output tokens per target forward pass over all steps.
    - ``identical``: prompts whose output equals the baseline's token for token.
    """
    prompts = run.prompts
    tokens = sum(len(p.output_ids) for p in prompts)
    seconds = sum(p.seconds for p in prompts)
    drafts = sum(p.drafts for p in prompts)
    accepted = sum(p.accepted_tokens for p in prompts)
    out = {
        "method": run.method,
        "prompts": len(prompts),
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "tokens_per_pass": tokens / max(1, sum(p.target_passes for p in prompts)),
        "draft_tokens_per_step": sum(p.draft_tokens for p in prompts) / drafts if drafts else 0.0,
    }
    if baseline is not None:
        base = {p.prompt_id: p for p in baseline.prompts}
        ratios = [p.tokens_per_s / base[p.prompt_id].tokens_per_s for p in prompts if p.prompt_id in base]
        out["identical"] = sum(p.output_ids == base[p.prompt_id].output_ids
                               for p in prompts if p.prompt_id in base)
        out["speedup_mean"] = statistics.fmean(ratios) if ratios else None
        out["speedup_geomean"] = math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else None
        out["speedup_median"] = statistics.median(ratios) if ratios else None
        out["speedup_min"] = min(ratios) if ratios else None
        out["speedup_max"] = max(ratios) if ratios else None
    return out


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A markdown table of ``rows`` with (key, header) ``columns``."""
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(_fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


SUMMARY_COLUMNS = [
    ("method", "method"), ("prompts", "prompts"), ("tokens_per_s", "tokens/s"),
    ("speedup_geomean", "speedup (geo)"), ("speedup_median", "speedup (median)"),
    ("speedup_min", "min"), ("speedup_max", "max"),
    ("acceptance_length", "accept len (vLLM)"), ("tokens_per_pass", "tokens/pass"),
    ("identical", "identical"),
]
