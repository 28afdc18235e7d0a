"""One tree-mode engine (SmolLM2, dtype auto, fixed forced drafts that are always rejected:
benchmarks.verify_cost's forced_tree) drawing a chain or a bushy tree of N nodes at random
per step; each step's engine.step() runs under the cProfile of its shape.

    python profile_tree_steps.py N CONTEXT STEPS OUTDIR   # writes OUTDIR/chain.prof, tree.prof
"""
import cProfile, pstats, sys, time, os
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import numpy as np
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4]))
OUT = sys.argv[4] if len(sys.argv) > 4 else "."
from benchmarks import verify_cost as vc

N = int(sys.argv[1]) if len(sys.argv) > 1 else 9
CTX = int(sys.argv[2]) if len(sys.argv) > 2 else 100
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 200
from vllm import LLM, SamplingParams, TokensPrompt
from vllm_recap.core.drafter import Drafter
from vllm_recap.models.engine import engine_kwargs, shutdown_llm
from vllm_recap.models import resolve_model
from benchmarks.machine import resolve_dtype
size = {"shape": "chain"}
original = Drafter.propose
draw = np.random.default_rng(1)
def propose(self, req_id, node_budget=None, max_depth=None):
    if req_id == "warmup":
        return original(self, req_id, node_budget, max_depth)
    size["shape"] = ("chain", "tree")[int(draw.integers(2))]
    return vc.forced_tree(self.history(req_id)[-1], N, size["shape"], self.vocab_size)
spec = {"method": "recap", "budget_policy": "fixed", "batch_node_budget": 0, "node_budget": N,
        "suffix_len": 0, "max_depth": 64, "draft_mode": "tree"}
Drafter.propose = propose
llm = LLM(**engine_kwargs(str(resolve_model("smollm2")), dtype=resolve_dtype("auto"), kv_cache_mib=2048, max_model_len=CTX + STEPS + 200,
                          speculative_config=spec))
prompt = np.random.default_rng(0).integers(100, 20000, CTX).tolist()
engine = llm.llm_engine
engine.add_request("cost", TokensPrompt(prompt_token_ids=prompt),
                   SamplingParams(temperature=0, max_tokens=STEPS + 4, ignore_eos=True))
profs = {"chain": cProfile.Profile(), "tree": cProfile.Profile()}
times = {"chain": [], "tree": []}
i = 0
while engine.has_unfinished_requests():
    tag = size["shape"]
    prof = profs[tag] if i > 5 else None
    t0 = time.perf_counter()
    if prof: prof.enable()
    engine.step()
    if prof: prof.disable()
    if i > 5: times[tag].append(time.perf_counter() - t0)
    i += 1
for tag in profs:
    print(tag, len(times[tag]), "median ms", 1e3 * np.median(times[tag]))
for tag in profs:
    st = pstats.Stats(profs[tag]); st.dump_stats(f"{OUT}/{tag}.prof")
Drafter.propose = original
shutdown_llm(llm)
