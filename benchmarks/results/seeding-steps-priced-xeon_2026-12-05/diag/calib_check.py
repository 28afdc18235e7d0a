"""Scratch: per (depth, prob bin, drafted/declined) replayed acceptance vs calibrated prob."""
import json, sys, os, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import numpy as np
from benchmarks import replay as R
from vllm import LLM, SamplingParams, TokensPrompt
from benchmarks.harness import model_runner
from benchmarks.workloads import first_spec_bench_prompts
from vllm_recap.models import resolve_model
from vllm_recap.models.engine import engine_kwargs, shutdown_llm
conc = int(sys.argv[1]); depth = 3
llm = LLM(**engine_kwargs(resolve_model("smollm2"), dtype="bfloat16",
                          speculative_config={"method": "recap"}, max_num_seqs=conc))
prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in
           first_spec_bench_prompts(llm.get_tokenizer(), 26)]
params = SamplingParams(temperature=0.0, max_tokens=64)
llm.generate(prompts[:1], params, use_tqdm=False)
props = R.record(model_runner(llm).drafter.recap_hooks, depth)
t0 = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
print("wall", time.perf_counter() - t0)
by_id = {o.request_id: [*o.prompt_token_ids, *o.outputs[0].token_ids] for o in outs}
outputs = {r: by_id[r.rsplit("-", 1)[0]] for r in {p.request for p in props}}
edges = [0, 0.03, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9, 1.01]
tab = {}
for p in props:
    toks = outputs[p.request]
    if p.num_tokens >= len(toks): continue
    acc = R.accepted_prefix(p.chain, toks, p.num_tokens)
    grp = "drafted" if p.scheduled else "declined"
    for d, pr in enumerate(p.probs[:depth]):
        # conditional: node d accepted given parent accepted
        if d > acc: break
        b = np.searchsorted(edges, pr, side="right") - 1
        key = (grp, d + 1, edges[b])
        t = tab.setdefault(key, [0, 0.0, 0.0])
        t[0] += 1; t[1] += float(d < acc); t[2] += pr / (p.probs[d-1] if d else 1.0)
for key in sorted(tab):
    n, a, e = tab[key]
    print(f"{key[0]:9s} depth {key[1]} p>={key[2]:.2f}: n={n:4d} accepted {a/n:.3f} expected(cond) {e/n:.3f}")
shutdown_llm(llm)
