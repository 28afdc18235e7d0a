import os, sys, json
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams, TokensPrompt
from benchmarks.workloads import first_spec_bench_prompts
from vllm_recap.models import resolve_model
from vllm_recap.models.engine import engine_kwargs, shutdown_llm
from vllm_recap.core import budget
import benchmarks.interleave as I
conc = int(sys.argv[1])  # run with PYTHONPATH=<checkout with budget-logging.diff applied>:<repo>
llm = LLM(**engine_kwargs(resolve_model("smollm2"), dtype="bfloat16",
                          speculative_config={"method": "recap"}, max_num_seqs=conc))
prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in first_spec_bench_prompts(llm.get_tokenizer(), 26)]
params = SamplingParams(temperature=0.0, max_tokens=64)
llm.generate(prompts[:1], params, use_tqdm=False)
n0 = len(budget.LOG)
import time; t=time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
print("WALL", time.perf_counter()-t)
from benchmarks.harness import model_runner
d = model_runner(llm).drafter.recap_hooks
print("STATS", d.stats)
for e in budget.LOG[n0:]:
    print("LOG", e)
shutdown_llm(llm)
