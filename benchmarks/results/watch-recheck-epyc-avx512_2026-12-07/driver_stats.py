"""One in-process run: RECAP's driver counters (idle, watched, tree steps) over 26 Spec-Bench
prompts x 64 at concurrency N under a sampling setting, float32 SmolLM2.

    PYTHONPATH=<checkout> python driver_stats.py qwen_vl 4
"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

setting, conc = sys.argv[1], int(sys.argv[2])
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams, TokensPrompt
import vllm_recap
from vllm_recap.models.engine import engine_kwargs
from benchmarks.run import resolve_model_path
from benchmarks.sampling import SAMPLINGS
from benchmarks.workloads import SPEC_BENCH, WARMUP_TEXT, render, spec_bench_prompts
model = resolve_model_path("smollm2")
tok = AutoTokenizer.from_pretrained(model)
prompts = [p.token_ids for p in spec_bench_prompts(tok, 2, None, SPEC_BENCH, 1536)]
llm = LLM(**engine_kwargs(model, dtype="float32", kv_cache_mib=1024, max_model_len=2400,
                          speculative_config={"method": "recap"}, max_num_seqs=conc))
params = SamplingParams(**SAMPLINGS[setting].params, max_tokens=64)
llm.generate([TokensPrompt(prompt_token_ids=render(tok, [WARMUP_TEXT]))], params, use_tqdm=False)
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
driver = runner.drafter.recap_hooks
before = dict(driver.stats)
t0 = time.perf_counter()
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
wall = time.perf_counter() - t0
stats = {k: v - before.get(k, 0) for k, v in driver.stats.items()}
toks = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"code": os.path.dirname(vllm_recap.__file__), "tokens": toks, "wall": wall,
                  "tps": toks / wall, **stats}))
