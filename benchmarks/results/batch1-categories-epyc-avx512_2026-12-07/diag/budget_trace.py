"""Budget decisions at batch 1 (bf16 auto), in process: the driver's DEBUG explain lines.

    python budget_trace.py '{"method": "recap"}' 13 budget13.log   # from the repository root
"""
import os, sys, logging
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.environ.get("CHECKOUT", "."))  # run from the repository root
from transformers import AutoTokenizer
from benchmarks.run import resolve_model_path
from benchmarks.workloads import SPEC_BENCH, spec_bench_prompts, render, WARMUP_TEXT
from benchmarks.machine import resolve_dtype
from vllm import LLM, SamplingParams, TokensPrompt
from vllm_recap.models.engine import engine_kwargs
import json
spec = json.loads(sys.argv[1]); n = int(sys.argv[2])
model = resolve_model_path("smollm2")
tok = AutoTokenizer.from_pretrained(model)
ps = spec_bench_prompts(tok, 2, None, SPEC_BENCH, 1536)[:n]
llm = LLM(**engine_kwargs(model, dtype=resolve_dtype("auto"), kv_cache_mib=1024, max_model_len=2400,
                          speculative_config=spec, max_num_seqs=1))
params = SamplingParams(temperature=0.0, max_tokens=128)
llm.generate([TokensPrompt(prompt_token_ids=render(tok, [WARMUP_TEXT]))], params, use_tqdm=False)
lg = logging.getLogger("vllm.recap"); lg.setLevel(logging.DEBUG)
h = logging.FileHandler(sys.argv[3], mode="w"); h.setLevel(logging.DEBUG); lg.addHandler(h)
import time; t = time.perf_counter()
outs = llm.generate([TokensPrompt(prompt_token_ids=p.token_ids) for p in ps], params, use_tqdm=False)
print("wall", time.perf_counter() - t, "tokens", sum(len(o.outputs[0].token_ids) for o in outs))
