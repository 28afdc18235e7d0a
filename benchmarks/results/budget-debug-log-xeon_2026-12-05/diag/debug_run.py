import os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
from vllm import LLM, SamplingParams, TokensPrompt
from benchmarks.workloads import first_spec_bench_prompts
from vllm_recap.models import resolve_model
from vllm_recap.models.engine import engine_kwargs, shutdown_llm
conc=int(sys.argv[1])
llm = LLM(**engine_kwargs(resolve_model("smollm2"), dtype="bfloat16", kv_cache_mib=1024, max_model_len=2400,
                          speculative_config={"method": "recap"}, max_num_seqs=conc))
prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in first_spec_bench_prompts(llm.get_tokenizer(), 26)]
params = SamplingParams(temperature=0.0, max_tokens=64)
llm.generate(prompts[:1], params, use_tqdm=False)
print("=== RUN ===", file=sys.stderr, flush=True)
t=time.perf_counter()
llm.generate(prompts, params, use_tqdm=False)
print("WALL", time.perf_counter()-t, file=sys.stderr)
shutdown_llm(llm)
