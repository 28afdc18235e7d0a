"""Side-by-side benchmark of speculative methods on one engine, model and prompt set.

    python -m benchmarks.run --quick            # the README's main job
    python -m benchmarks.run --model gemma3 --per-category 5 --max-new-tokens 128

Every method runs on the same prompts, one at a time (batch 1), greedy; speedups are paired per
prompt against ``none`` (no speculation) from the same run. Results: JSON of the whole run and
a markdown table under ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: fast start

from benchmarks.harness import run_method  # noqa: E402
from benchmarks.methods import METHODS, method_config  # noqa: E402
from benchmarks.report import SUMMARY_COLUMNS, markdown_table, summarize  # noqa: E402
from benchmarks.workloads import SPEC_BENCH, spec_bench_prompts  # noqa: E402

QUICK_CATEGORIES = ["summarization", "rag", "qa", "translation", "math_reasoning", "coding"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | path to a local HF model folder")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {list(METHODS)}")
    p.add_argument("--data", default=str(SPEC_BENCH), help="Spec-Bench-format JSONL file")
    p.add_argument("--categories", default=None, help="comma list of categories (default: all)")
    p.add_argument("--per-category", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=1536)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quick", action="store_true",
                   help="1 question from each of 6 categories, 64 new tokens (a few minutes)")
    p.add_argument("--out", default="benchmarks/results/latest", help="folder for JSON + markdown")
    args = p.parse_args(argv)
    if args.quick:
        args.per_category, args.max_new_tokens = 1, 64
        args.categories = args.categories or ",".join(QUICK_CATEGORIES)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from transformers import AutoTokenizer
    from tqdm import tqdm

    from vllm_recap.models import resolve_model
    from vllm_recap.models.engine import engine_kwargs

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    configs = {m: method_config(m) for m in methods}  # fail on an unknown name before any work
    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = spec_bench_prompts(tokenizer, args.per_category,
                                 args.categories.split(",") if args.categories else None,
                                 args.data, args.max_prompt_tokens)
    kwargs = engine_kwargs(model, dtype=args.dtype, max_model_len=args.max_prompt_tokens + args.max_new_tokens + 64)
    runs = []
    with tqdm(total=len(prompts) * len(methods), desc="benchmark", unit="prompt") as bar:
        for name in methods:
            bar.set_postfix_str(name)
            runs.append(run_method(name, configs[name], kwargs, prompts, args.max_new_tokens, bar))
    baseline = next((r for r in runs if r.method == "none"), None)
    summary = [summarize(r, baseline) for r in runs]
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "args": vars(args),
        "model": model,
        "summary": summary,
        "runs": [r.to_dict() for r in runs],
    }
    table = markdown_table(summary, SUMMARY_COLUMNS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    header = (f"{args.model}, {len(prompts)} Spec-Bench prompts, {args.max_new_tokens} new tokens, "
              f"greedy, batch 1, {args.dtype}; {result['date']} on {result['machine']['platform']}, "
              f"{result['machine']['cpus']} CPUs")
    (out / "summary.md").write_text(f"{header}\n\n{table}\n")
    print(f"\n{header}\n\n{table}\n\nwritten: {out}/result.json, {out}/summary.md")
    return result


if __name__ == "__main__":
    main()
