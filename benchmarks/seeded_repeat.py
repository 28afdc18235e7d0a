"""Do seeded sampled requests repeat run to run? Each speculative config runs the same seeded
requests in two fresh engines (one request at a time, as a batch-1 client sends them) and
counts the outputs that came out identical, and (with ``none`` among the configs) those equal
to vLLM's without speculation. ``none-batched`` sends every prompt in one batch, without
speculation: in bf16 vLLM's own seeded outputs move with the batch they run in.

RECAP draws output token k of a seeded request with draw k of the request's seed stream, as
vLLM's CPU sampler does without speculation (``vllm_recap/vllm/seeded.py``), so its outputs
do not follow the trees it verified, which follow the machine's timing where the adaptive
budget or the prompt-seeding time bound shape them. (Before, a tree step drew one uniform
per tree row from the request's generator: 0 of 13 outputs repeated with the defaults.) In
bf16 a pass of several tokens rounds rows differently from a one-token pass, which can move
a draw near a tie; float32 (``--dtype float32``) shows the identity.

    python -m benchmarks.seeded_repeat --prompts 13 --out benchmarks/results/<folder>/repeat.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine runs in this process

from benchmarks.sampling import SAMPLINGS  # noqa: E402

# Settings that sample (greedy-equivalent ones repeat whatever the drafts)
SAMPLED = [name for name, s in SAMPLINGS.items() if not s.deterministic]

CONFIGS = {
    "none": None,
    # no speculation, every prompt in one batch: vLLM's own outputs move with the batch where
    # the dtype rounds differently for other batch shapes (bf16)
    "none-batched": None,
    "recap": {"method": "recap"},  # the defaults
    "recap-fixed8": {"method": "recap", "budget_policy": "fixed", "node_budget": 8,
                      "batch_node_budget": 0},
    "recap-fixed8-noseed": {"method": "recap", "budget_policy": "fixed",
                            "node_budget": 8, "batch_node_budget": 0, "prompt_seed_rows": 0},
}


def outputs(spec: dict | None, args, batched: bool = False) -> list[list[int]]:
    """The configs' outputs of the first ``args.prompts`` Spec-Bench prompts, one at a time
    (``batched``: all in one ``generate`` call)."""
    from vllm import LLM, SamplingParams, TokensPrompt

    from benchmarks.workloads import first_spec_bench_prompts
    from vllm_recap.models import resolve_model
    from vllm_recap.models.engine import engine_kwargs, shutdown_llm

    kwargs = {} if spec is None else {"speculative_config": spec}
    llm = LLM(**engine_kwargs(resolve_model(args.model), dtype=args.dtype, **kwargs))
    try:
        prompts = first_spec_bench_prompts(llm.get_tokenizer(), args.prompts)
        setting = SAMPLINGS[args.sampling].params
        params = [SamplingParams(**setting, seed=args.seed + i, max_tokens=args.max_new_tokens,
                                 ignore_eos=True) for i in range(len(prompts))]
        prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts]
        if batched:
            return [list(r.outputs[0].token_ids)
                    for r in llm.generate(prompts, params, use_tqdm=False)]
        return [list(llm.generate([p], [s], use_tqdm=False)[0].outputs[0].token_ids)
                for p, s in zip(prompts, params)]
    finally:
        shutdown_llm(llm)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=13)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--sampling", default="qwen_text", choices=SAMPLED,
                    help="a sampled setting of benchmarks/sampling.py")
    ap.add_argument("--seed", type=int, default=100, help="request i gets seed + i")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma list of: " + ", ".join(CONFIGS))
    ap.add_argument("--out", default=None, help="also write the counts to this JSON file")
    args = ap.parse_args(argv)
    from benchmarks.machine import cpu_line

    names = [c.strip() for c in args.configs.split(",")]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    rows, plain = [], None
    for name in sorted(names, key=lambda n: n != "none"):  # none first: the reference
        batched = name.endswith("-batched")
        first, second = (outputs(CONFIGS[name], args, batched),
                         outputs(CONFIGS[name], args, batched))
        same = sum(a == b for a, b in zip(first, second))
        if name == "none":
            plain = first
        row = {"config": name, "spec": CONFIGS[name], "identical": same, "prompts": len(first)}
        line = f"{name}: {same} of {len(first)} outputs identical run to run"
        if plain is not None:
            row["as_none"] = [sum(a == b for a, b in zip(run, plain)) for run in (first, second)]
            line += f", {row['as_none']} equal to none's in each run"
        rows.append(row)
        print(line, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "machine": cpu_line(), "model": args.model, "dtype": args.dtype,
            "sampling": args.sampling, "max_new_tokens": args.max_new_tokens,
            "seed": args.seed, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
