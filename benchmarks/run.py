"""RECAP against every peer, side by side, on one engine, model and prompt set; greedy, and
optionally under other sampling settings.

    python -m benchmarks.run --quick          # README main job: core methods, 4 short prompts
    python -m benchmarks.run                  # full: all workloads, concurrency 1/4/16, ablations
    python -m benchmarks.run --methods budgets --per-category 5 --max-new-tokens 128 \\
        --workloads spec_bench --concurrency 1 --ablations none      # fixed budgets 4..32
    python -m benchmarks.run --model gemma3 --methods none,ngram,recap-tree
    python -m benchmarks.run --per-category 2 --max-new-tokens 128 --workloads spec_bench \\
        --concurrency 1 --ablations none --sampling greedy,qwen_vl,qwen_text,t1 \\
        --methods none,ngram,suffix,recap-chain,recap-tree     # issue 12's sampled workloads

Methods (``--methods``, names or groups; see benchmarks/methods.py):
  core      none, ngram, suffix, token-recycling, recap-chain, recap-tree
  budgets   none, ngram, recap-chain, recap-tree-b4/b8/b16/b32, token-recycling
  ablations the six paper ablations at a fixed budget of 16 (with recap-tree-b16 as reference)
  continuations the continuation additions, each off alone at budget 16 (--ablations continuations)
  also      token-recycling-80 (paper's 80-node template), abl-backoff-only, abl-seed,
            recap-tree-classic
            (RECAP tree without the continuation additions)

Sampling settings (``--sampling``, see benchmarks/sampling.py): greedy (default), qwen_vl,
qwen_text, t1. Greedy runs everything selected; every other setting adds the batch-1 Spec-Bench
jobs of ``--sampling-methods`` under that setting, paired against ``none`` under the same setting.

Every (method, workload, concurrency, sampling setting, repeat) runs in a fresh process and
engine; batch-1 prompts are timed one at a time and paired per prompt against ``none`` from the
same run.
Results: ``<out>/result.json`` (everything, outputs included), ``<out>/summary.md``, three PNG
plots, per-job logs under ``<out>/jobs/``. The full default mode takes hours on a 2-core CPU
(about 13 categories x 5 prompts x 128 tokens per method and phase at ~10 tokens/s); select
parts with the flags below.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines run in the job process

from benchmarks import precision, report  # noqa: E402
from benchmarks.harness_worker import REPO, preload, run_isolated, write_json  # noqa: E402
from benchmarks.machine import machine_info, resolve_dtype, suffix_status  # noqa: E402
from benchmarks.methods import ABLATION_REFERENCE, METHODS, expand  # noqa: E402
from benchmarks.sampling import GREEDY, SAMPLINGS, job_sampling, parse_settings  # noqa: E402
from benchmarks.workloads import (  # noqa: E402
    SPEC_BENCH,
    WARMUP_TEXT,
    multimodal_items,
    render,
    spec_bench_prompts,
    two_turn_conversations,
)

WORKLOADS = ("spec_bench", "two_turn", "multimodal")
QUICK_CATEGORIES = ["translation", "qa", "math_reasoning", "coding"]  # short prompts, varied answers
MM_WARMUP = {"prompt_id": "mm-warmup", "category": "image", "question": "What is this?",
             "image_seed": 100, "image_size": [56, 56]}
# Full / quick defaults of the flags that depend on the mode (None in argparse = not given).
FULL = {"methods": "core", "workloads": ",".join(WORKLOADS), "categories": None, "per_category": 5,
        "max_new_tokens": 128, "concurrency": "1,4,16", "ablations": "ablations"}
QUICK = {"methods": "core", "workloads": "spec_bench", "categories": ",".join(QUICK_CATEGORIES),
         "per_category": 1, "max_new_tokens": 48, "concurrency": "1", "ablations": "none"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"quick mode (README main job, < 5 min here): defaults become {QUICK}, "
                        "output benchmarks/results/quick; explicit flags still win")
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (SmolLM2-135M-Instruct) | gemma3 (Gemma-3-270M base) | path to a "
                        "local HF model folder (default: smollm2)")
    p.add_argument("--methods", default=None,
                   help=f"comma list of method names and groups (default: core); none is always "
                        f"added, every figure is paired against it. Names: {', '.join(METHODS)}")
    p.add_argument("--workloads", default=None,
                   help=f"comma list of {', '.join(WORKLOADS)} (default: all; quick: spec_bench)")
    p.add_argument("--data", default=str(SPEC_BENCH),
                   help="Spec-Bench-format JSONL (question_id, category, turns) (default: the bundled copy)")
    p.add_argument("--categories", default=None,
                   help=f"comma list of Spec-Bench categories (default: all; quick: {','.join(QUICK_CATEGORIES)})")
    p.add_argument("--per-category", type=int, default=None,
                   help="Spec-Bench prompts per category (default: 5; quick: 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="tokens per answer (default: 128; quick: 48)")
    p.add_argument("--max-prompt-tokens", type=int, default=1536,
                   help="skip Spec-Bench prompts longer than this (default: 1536)")
    p.add_argument("--concurrency", default=None,
                   help="comma list of requests in flight for the load test on the Spec-Bench "
                        "prompts; 1 = the batch-1 run (default: 1,4,16; quick: 1)")
    p.add_argument("--load-methods", default=None,
                   help="methods of the load test at concurrency > 1 (default: --methods)")
    p.add_argument("--load-prompts", type=int, default=None,
                   help="serve only the first N Spec-Bench prompts at concurrency > 1 (the "
                        "concurrency-1 row still covers all) (default: all)")
    p.add_argument("--ablations", default=None,
                   help="'ablations' (the six paper ablations), a comma list of ablation methods, "
                        "or 'none' (default: ablations; quick: none). Run at a fixed budget of 16 "
                        f"against {ABLATION_REFERENCE}, on the Spec-Bench prompts, batch 1")
    p.add_argument("--two-turn-per-category", type=int, default=1,
                   help="two-turn conversations per MT-bench category (default: 1, i.e. 8)")
    p.add_argument("--two-turn-methods", default=None,
                   help="methods of the two_turn workload (default: --methods)")
    p.add_argument("--two-turn-categories", default=None,
                   help="comma list of MT-bench categories for two_turn (default: all 8)")
    p.add_argument("--mm-methods", default="none,ngram,recap-tree",
                   help="methods of the multimodal workload (default: none,ngram,recap-tree)")
    p.add_argument("--mm-prompts", type=int, default=4, help="image prompts (default: 4, max 6)")
    p.add_argument("--mm-model", default=None,
                   help="vision-language model folder (default: build the tiny random Qwen2.5-VL, seed 0)")
    p.add_argument("--sampling", default=GREEDY,
                   help=f"comma list of sampling settings: {', '.join(SAMPLINGS)} (default: greedy). "
                        "greedy runs every selected workload as always; each other setting adds "
                        "the batch-1 Spec-Bench prompts under it, paired against none under the "
                        "same setting (greedy = temperature 0; qwen_vl = T 0.1, top_k 1, top_p "
                        "0.001, rep 1.05, greedy-equivalent; qwen_text = T 0.7, top_p 0.8, top_k "
                        "20, rep 1.05; t1 = T 1.0)")
    p.add_argument("--sampling-methods", default=None,
                   help="methods run under the settings other than greedy (default: --methods; "
                        "none is always added)")
    p.add_argument("--sampling-seed", type=int, default=0,
                   help="base of the fixed per-request seeds of sampled settings (a request's "
                        "seed depends on it and the prompt id only); -1: unseeded (default: 0)")
    p.add_argument("--dtype", default="auto",
                   help="auto = bfloat16 if the CPU has AVX-512 BF16, else float32 (emulated bf16 "
                        "is slower and inexact here); or any vLLM dtype (default: auto)")
    p.add_argument("--kv-cache-mib", type=int, default=1024,
                   help="KV cache per engine in MiB; raise it if the load table reports "
                        "preemptions (default: 1024)")
    p.add_argument("--no-fp32-recheck", action="store_true",
                   help="skip rerunning in float32 the greedy batch-1 prompts whose output "
                        "differed from none in a bfloat16 run (default: rerun them; see "
                        "benchmarks/precision.py)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every job N times, method order reversed on odd repeats; a prompt's "
                        "seconds are the median over repeats (default: 1)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-new-tokens (default: stop at EOS)")
    p.add_argument("--isolation", choices=("fork", "spawn"), default="fork",
                   help="fork: children of a parent that imported vLLM once (fast); spawn: a fresh "
                        "python per job (default: fork)")
    p.add_argument("--job-timeout", type=float, default=3600.0,
                   help="seconds before a job's process is killed and recorded as failed (default: 3600)")
    p.add_argument("--out", default=None,
                   help="output folder (default: benchmarks/results/<timestamp>; quick: benchmarks/results/quick)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    try:
        parse_settings(args.sampling)
    except ValueError as e:
        p.error(str(e))
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        args.out = str(REPO / "benchmarks" / "results" / ("quick" if args.quick else stamp))
    return args


def _csv(text: str | None) -> list[str]:
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def resolve_model_path(name: str) -> str:
    """The model folder, resolved in a separate process: a first use converts the embedded GGUF
    with torch, and the parent must not run torch before it forks the job processes."""
    code = "import sys; from vllm_recap.models import resolve_model; print(resolve_model(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, name], capture_output=True, text=True, cwd=REPO)
    if out.returncode:
        raise SystemExit(f"cannot resolve model {name!r}:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


class Plan:
    """The run's jobs, in execution order, built from the arguments and the tokenized prompts."""

    def __init__(self, args: argparse.Namespace, model: str, dtype: str, tokenizer) -> None:
        from vllm_recap.models.engine import engine_kwargs

        self.args = args
        # none is always run: every speedup, identity check and turn-2 prompt comes from it
        self.methods = expand("none," + args.methods)
        self.settings = parse_settings(args.sampling)
        self.greedy = GREEDY in self.settings
        self.sampling_methods = expand("none," + (args.sampling_methods or args.methods))
        self.workloads = _csv(args.workloads)
        unknown = sorted(set(self.workloads) - set(WORKLOADS))
        if unknown:
            raise SystemExit(f"unknown workloads {unknown}; choose from {WORKLOADS}")
        self.concurrency = sorted({int(c) for c in _csv(args.concurrency)})
        self.ablations = [] if args.ablations == "none" else [
            m for m in expand(args.ablations) if m != ABLATION_REFERENCE]
        self.load_methods = expand("none," + (args.load_methods or args.methods))
        self.two_turn_methods = expand("none," + (args.two_turn_methods or args.methods))
        self.mm_methods = (expand("none," + args.mm_methods)
                           if "multimodal" in self.workloads and self.greedy else [])
        if not self.greedy:  # only the other settings' batch-1 Spec-Bench jobs run
            self.ablations, self.load_methods, self.two_turn_methods = [], [], []
        self.prompts = spec_bench_prompts(tokenizer, args.per_category, _csv(args.categories) or None,
                                          args.data, args.max_prompt_tokens)
        self.conversations = (two_turn_conversations(tokenizer, args.two_turn_per_category,
                                                     _csv(args.two_turn_categories) or None, args.data)
                              if "two_turn" in self.workloads and self.greedy else [])
        self.mm_items = multimodal_items(args.mm_prompts) if self.mm_methods else []
        self.warmup_ids = render(tokenizer, [WARMUP_TEXT])
        longest = max([len(p.token_ids) for p in self.prompts] +
                      [len(c["turn1_ids"]) for c in self.conversations] + [256])
        self.engine = engine_kwargs(model, dtype=dtype, kv_cache_mib=args.kv_cache_mib,
                                    max_model_len=longest + 2 * args.max_new_tokens + 512)
        self.mm_dir = None
        if self.mm_methods:
            self.mm_dir = args.mm_model or str(Path(tempfile.mkdtemp(prefix="recap-bench-vl-")) / "model")
            self.mm_engine = engine_kwargs(self.mm_dir, dtype=dtype, kv_cache_mib=256, max_model_len=2048,
                                           limit_mm_per_prompt={"image": 1, "video": 0})
        self.jobs = [job for r in range(args.repeats) for job in self._repeat(r)]
        # bf16 outputs that differ from none are rerun in float32 (benchmarks/precision.py)
        self.fp32_recheck = (not args.no_fp32_recheck and dtype != "float32" and self.greedy
                             and "spec_bench" in self.workloads)

    def batch1_methods(self) -> list[str]:
        extra = [ABLATION_REFERENCE, *self.ablations] if self.ablations else []
        return list(dict.fromkeys(self.methods + extra))

    def _job(self, method: str, phase: str, concurrency: int, repeat: int,
             sampling: str = GREEDY, **payload) -> dict:
        # greedy jobs keep their historical names (and log file names)
        where = phase if sampling == GREEDY else f"{phase}/{sampling}"
        return {"name": f"{method}/{where}/c{concurrency}/r{repeat}", "method": method,
                "phase": phase, "concurrency": concurrency, "repeat": repeat,
                "sampling": job_sampling(sampling, self.args.sampling_seed),
                "speculative_config": METHODS[method].config, "engine": self.engine,
                "max_new_tokens": self.args.max_new_tokens, "ignore_eos": self.args.ignore_eos,
                "warmup_ids": self.warmup_ids, **payload}

    def _repeat(self, r: int) -> list[dict]:
        """One repeat: greedy's jobs (if greedy is selected), then each other setting's batch-1
        Spec-Bench jobs; odd repeats reverse method order (ABBA) so a drift in machine speed
        does not favour the methods that run first."""
        order = (lambda ms: ms) if r % 2 == 0 else (lambda ms: ms[::-1])
        prompts = [p.to_dict() for p in self.prompts]
        jobs = self._greedy_jobs(r, order, prompts) if self.greedy else []
        for setting in self.settings:
            if setting != GREEDY:
                jobs += [self._job(m, "spec_bench", 1, r, setting, prompts=prompts)
                         for m in order(self.sampling_methods)]
        return jobs

    def _greedy_jobs(self, r: int, order, prompts: list[dict]) -> list[dict]:
        """Greedy's jobs of repeat ``r``: batch 1, two-turn, load, multimodal."""
        jobs: list[dict] = []
        if "spec_bench" in self.workloads or self.ablations:
            names = self.batch1_methods() if "spec_bench" in self.workloads else \
                [ABLATION_REFERENCE, *self.ablations]
            jobs += [self._job(m, "spec_bench", 1, r, prompts=prompts) for m in order(names)]
        if self.conversations:
            # none first: its first answers become everyone's turn-2 prompts
            names = sorted(order(self.two_turn_methods), key=lambda m: m != "none")
            jobs += [self._job(m, "two_turn", 1, r, conversations=self.conversations) for m in names]
        load = prompts[: self.args.load_prompts] if self.args.load_prompts else prompts
        if "spec_bench" in self.workloads:
            jobs += [self._job(m, "spec_bench", c, r, prompts=load)
                     for c in self.concurrency if c > 1 for m in order(self.load_methods)]
        for m in order(self.mm_methods):
            jobs.append({**self._job(m, "multimodal", 1, r, items=self.mm_items),
                         "engine": self.mm_engine, "warmup_item": MM_WARMUP,
                         "build_tiny_vl": self.args.mm_model is None})
        return jobs

    def requests(self, job: dict) -> int:
        return len(job.get("prompts") or job.get("items") or []) + 2 * len(job.get("conversations") or [])


def run_jobs(plan: Plan, workdir: Path, jobs: list[dict] | None = None,
             desc: str = "benchmark") -> list[dict]:
    """Runs every job (default: the plan's) in its own process with a progress bar over all
    requests."""
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: the parent must stay single-threaded to fork
    jobs = plan.jobs if jobs is None else jobs
    results: list[dict] = []
    total = sum(plan.requests(j) for j in jobs)
    with tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True) as bar:
        for i, job in enumerate(jobs, 1):
            if job["phase"] == "two_turn" and job["method"] != "none":
                job = _with_turn2(job, results)
            bar.set_postfix_str(f"job {i}/{len(jobs)}: {job['name']}")
            result = run_isolated(job, workdir, plan.args.isolation, plan.args.job_timeout, bar.update)
            if result.get("error"):
                bar.write(f"{job['name']} failed: {report.error_line([result])} (log: {result['log']})")
            results.append(result)
            with open(workdir / "results.jsonl", "a") as f:  # a killed run keeps what it measured
                f.write(json.dumps(result) + "\n")
    return results


def _with_turn2(job: dict, results: list[dict]) -> dict:
    """Gives every method the turn-2 prompts rendered from none's first answers."""
    done = next((r for r in results if r["method"] == "none" and r["phase"] == "two_turn"
                 and r.get("turn2_ids")), None)
    if done is None:
        return job
    convs = [{**c, "turn2_ids": done["turn2_ids"].get(c["prompt_id"])} for c in job["conversations"]]
    return {**job, "conversations": convs}


def main(argv: list[str] | None = None) -> dict:
    t0 = time.perf_counter()
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from benchmarks import markdown, plots

    model = resolve_model_path(args.model)
    dtype = resolve_dtype(args.dtype)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    machine = machine_info()
    plan = Plan(args, model, dtype, AutoTokenizer.from_pretrained(model))
    out = Path(args.out)
    workdir = out / "jobs"
    if workdir.exists():
        shutil.rmtree(workdir)
    if args.isolation == "fork":
        preload()
    try:
        results = run_jobs(plan, workdir)
        if plan.fp32_recheck:
            rechecks = precision.recheck_jobs(results, plan.batch1_methods(),
                                              [p.to_dict() for p in plan.prompts], plan._job,
                                              plan.engine)
            if rechecks:
                results += run_jobs(plan, workdir, rechecks, desc="float32 recheck")
    finally:
        if plan.mm_dir and args.mm_model is None:
            shutil.rmtree(Path(plan.mm_dir).parent, ignore_errors=True)
    summary = report.build_summary(results, plan.methods, plan.concurrency if "spec_bench" in
                                   plan.workloads else [], plan.ablations, plan.mm_methods,
                                   plan.load_methods, plan.two_turn_methods, plan.settings,
                                   plan.sampling_methods, args.sampling_seed, dtype)
    model_name = args.model if args.model in ("smollm2", "gemma3") else Path(model).name
    listed = ((plan.batch1_methods() if plan.greedy else []) + plan.load_methods +
              plan.two_turn_methods + plan.mm_methods +
              (plan.sampling_methods if plan.settings != [GREEDY] else []))
    result = {
        "date": started, "args": vars(args), "machine": machine,
        "load_average_end": list(os.getloadavg()), "model": model, "model_name": model_name,
        "dtype": dtype, "engine": plan.engine, "suffix": suffix_status(),
        "methods": {m: {"config": METHODS[m].config, "about": METHODS[m].about}
                    for m in dict.fromkeys(listed)},
        "categories": list(dict.fromkeys(p.category for p in plan.prompts)),
        "prompts": [{"prompt_id": p.prompt_id, "category": p.category, "prompt_tokens": len(p.token_ids)}
                    for p in plan.prompts],
        "summary": summary, "jobs": results,
    }
    result["plots"] = [str(p) for p in plots.draw_all(summary, out, model_name)]
    result["wall_s"] = time.perf_counter() - t0
    write_json(out / "result.json", result)
    text = markdown.render(result)
    (out / "summary.md").write_text(text)
    print(f"\n{text}\nwritten: {out}/result.json, summary.md, "
          f"{', '.join(Path(p).name for p in result['plots'])}; job logs in {workdir}")
    return result


if __name__ == "__main__":
    main()
