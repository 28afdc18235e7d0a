"""How the "before" tables (code 7bd52b2, one calibration factor for every source) were taken:
the same measure as `benchmarks.replay`'s calibration table, whose recorder needs the budget to
receive the sources (d1b8803 on), so this one reads the tree from the driver's frame.
    python before_7bd52b2.py '{"method": "recap"}' 4 26 64   # and 1 13 128, from a 7bd52b2 checkout
"""
import os, sys, json, time, collections, sys as _s
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, "/work/main")
import numpy as np
from vllm import LLM, SamplingParams, TokensPrompt
from vllm_recap.models import resolve_model
from vllm_recap.models.engine import engine_kwargs
from benchmarks.workloads import first_spec_bench_prompts
from benchmarks.harness import model_runner
spec = json.loads(sys.argv[1]); conc = int(sys.argv[2]); n = int(sys.argv[3]); mt = int(sys.argv[4])
llm = LLM(**engine_kwargs(resolve_model("smollm2"), dtype="bfloat16", speculative_config=spec, max_num_seqs=conc))
bench = first_spec_bench_prompts(llm.get_tokenizer(), n)
params = SamplingParams(temperature=0.0, max_tokens=mt)
prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in bench]
driver = model_runner(llm).drafter.recap_hooks
budget = driver.budget
orig = budget.observe_tree
rec = []
def observe_tree(parents, scores, accepted, depths=None, kind="greedy"):
    tree = _s._getframe(1).f_locals.get("tree")
    if len(parents) > 1 and tree is not None and tree.sources is not None:
        nn = len(parents)
        p = budget.calibration(kind).probability_list(depths, parents, scores)
        acc = np.zeros(nn, bool)
        a = np.arange(1, int(accepted) + 1) if np.isscalar(accepted) else np.asarray(accepted)
        acc[a] = True
        for v in range(1, nn):
            rec.append((int(tree.sources[v]), int(depths[v]), float(scores[v]), p[v], bool(acc[v])))
    return orig(parents, scores, accepted, depths, kind)
budget.observe_tree = observe_tree
llm.generate(prompts[:conc], params, use_tqdm=False)
rec.clear()
t = time.perf_counter(); outs = llm.generate(prompts, params, use_tqdm=False); wall = time.perf_counter() - t
print("wall %.1f tok/s %.1f nodes %d" % (wall, sum(len(o.outputs[0].token_ids) for o in outs) / wall, len(rec)))
names = {1: "mem", 2: "suf", 4: "shared"}
def nm(s): return "+".join(v for k, v in names.items() if s & k) or str(s)
g = collections.defaultdict(lambda: [0, 0.0, 0])
for s, d, sc, p, a in rec:
    for key in [(nm(s), 0), (nm(s), min(d, 4))]:
        x = g[key]; x[0] += 1; x[1] += p; x[2] += a
print("source depth(0=all,4=4+) nodes sumP accepted acc/P")
for k in sorted(g):
    x = g[k]; print(f"{k[0]:12s} {k[1]} {x[0]:6d} {x[1]:8.1f} {x[2]:6d} {x[2]/max(x[1],1e-9):5.2f}")
