"""Per-step anatomy at concurrency C: forward (begin_step end -> sample start), sample, propose,
and vLLM's glue (propose end -> next begin_step start), by step kind and draft count."""
import os, sys, time, json, collections, statistics
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.getcwd())
import argparse
ap = argparse.ArgumentParser()
ap.add_argument("--spec", default='{"method": "recap"}')
ap.add_argument("--prompts", type=int, default=16)
ap.add_argument("--concurrency", type=int, default=4)
ap.add_argument("--max-new-tokens", type=int, default=64)
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--out", default=None)
args = ap.parse_args()
from vllm import LLM, TokensPrompt
from benchmarks.harness import model_runner
from benchmarks.sampling import job_sampling, sampling_params
from benchmarks.workloads import spec_bench_prompts
from vllm_recap.models import resolve_model
from vllm_recap.models.engine import engine_kwargs, shutdown_llm
llm = LLM(**engine_kwargs(resolve_model("smollm2"), dtype=args.dtype, speculative_config=json.loads(args.spec)))
prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in spec_bench_prompts(llm.get_tokenizer(), -(-args.prompts // 13))[:args.prompts]]
params = sampling_params(job_sampling("greedy", 0), args.max_new_tokens, True)
runner_ = model_runner(llm)
d = runner_.drafter.recap_hooks
model_ = runner_.model
def _pre(m, a, k=None):
    cur["t_m0"] = time.perf_counter()
def _post(m, a, o):
    cur["t_m1"] = time.perf_counter()
model_.register_forward_pre_hook(_pre)
model_.register_forward_hook(_post)
_cl = d.compute_logits
def _cl_timed(h):
    t = time.perf_counter(); r = _cl(h); cur["lm"] = cur.get("lm", 0) + time.perf_counter() - t; return r
d.compute_logits = _cl_timed
rec = []
cur = {}
ob, osa, opr = d.begin_step, d.sample, d.propose
def begin_step(runner, so):
    t0 = time.perf_counter()
    r = ob(runner, so)
    t1 = time.perf_counter()
    ctx = d.scope.current
    cur.clear()
    cur.update(t_begin0=t0, t_begin1=t1, drafts=int(ctx.plan.num_drafts.sum()) if ctx else -1,
               trees=len(ctx.plan.trees) if ctx else 0, idle=bool(ctx.idle) if ctx else None,
               reqs=len(ctx.plan.req_ids) if ctx else 0,
               prefill=bool(ctx and (ctx.plan.num_scheduled > ctx.plan.num_drafts + 1).any()))
    return r
def sample(*a, **k):
    t0 = time.perf_counter()
    r = osa(*a, **k)
    cur.update(t_s0=t0, t_s1=time.perf_counter())
    return r
def propose(*a, **k):
    t0 = time.perf_counter()
    r = opr(*a, **k)
    cur.update(t_p0=t0, t_p1=time.perf_counter(), committed=sum(len(x) for x in a[2]))
    rec.append(dict(cur))
    return r
d.begin_step, d.sample, d.propose = begin_step, sample, propose
decisions = []
FORCE = [0, [int(x) for x in os.environ["FORCE"].split(",")]] if os.environ.get("FORCE") else None
_choose = d.budget.choose
def choose(trees, fixed, kinds=None, context=0, chains=False):
    b = d.budget
    probs = [b.calibration(k).probability_list(t.depths, t.parents, t.scores) for t, k in zip(trees, kinds or ["greedy"]*len(trees))]
    levels = [0, 1, 2, 4, 8]
    est = b.cost.estimates(fixed + len(trees), context, [(l, True) for l in levels])
    estc = b.cost.estimates(fixed + len(trees), context, [(l, False) for l in levels])
    r = _choose(trees, fixed, kinds, context, chains)
    if FORCE is not None and len(trees) == 4:
        FORCE[0] += 1
        want = FORCE[1][FORCE[0] % len(FORCE[1])]
        order = sorted(range(len(trees)), key=lambda i: -(max(probs[i][1:]) if len(probs[i]) > 1 else 0))
        counts = [0] * len(trees)
        for j in range(want):
            i = order[j % len(order)]
            if len(probs[i]) > 1 + counts[i]:
                counts[i] += 1
        b.last_counts = counts; b.last_choice = max(counts); b.last_chain = True
        from vllm_recap.core.budget import Decision
        b.last_decision = Decision(sum(counts), 0.015, 0.5, True) if sum(counts) else None
        r = b.last_choice
    decisions.append(dict(n=len(trees), top=sorted((max(p[1:]) if len(p) > 1 else 0.0) for p in probs)[::-1],
                          level=b.last_decision.level if b.last_decision else 0, chain=b.last_chain,
                          est=est, estc=estc, ratios=b.outcomes.ratio_list([1,2,4,8], True), ratiosc=b.outcomes.ratio_list([1,2,4,8], False)))
    return r
d.budget.choose = choose
llm.generate(prompts[:4], params, use_tqdm=False)
rec.clear()
t0 = time.perf_counter()
for s in range(0, len(prompts), args.concurrency):
    llm.generate(prompts[s:s + args.concurrency], params, use_tqdm=False)
wall = time.perf_counter() - t0
rows = []
for a, b in zip(rec, rec[1:]):
    if "t_s0" not in a or "t_p1" not in a:
        continue
    rows.append(dict(drafts=a["drafts"], trees=a["trees"], idle=a["idle"], reqs=a["reqs"], prefill=a["prefill"],
                     begin=(a["t_begin1"]-a["t_begin0"])*1e3, fwd=(a["t_s0"]-a["t_begin1"])*1e3,
                     sample=(a["t_s1"]-a["t_s0"])*1e3, between=(a["t_p0"]-a["t_s1"])*1e3,
                     propose=(a["t_p1"]-a["t_p0"])*1e3, glue=(b["t_begin0"]-a["t_p1"])*1e3,
                     step=(b["t_begin0"]-a["t_begin0"])*1e3, committed=a["committed"],
                     model=(a.get("t_m1",0)-a.get("t_m0",0))*1e3, lm=a.get("lm",0)*1e3))
print(f"wall {wall:.2f} s, {len(rec)} steps, spec {args.spec}")
def bucket(r):
    if r["prefill"]: return "prefill"
    if r["reqs"] != args.concurrency: return "partial"
    if r["drafts"] == 0: return "idle" if r["idle"] else "declined"
    k = r["drafts"]
    b = "1-4" if k <= 4 else "5-8" if k <= 8 else "9-16" if k <= 16 else "17-32" if k <= 32 else ">32"
    return f"{b} {'tree' if r['trees'] else 'chain'}"
g = collections.defaultdict(list)
for r in rows: g[bucket(r)].append(r)
cols = ["begin", "model", "lm", "fwd", "sample", "between", "propose", "glue", "step", "committed"]
print(f"{'kind':14s} {'n':>4s} " + " ".join(f"{c:>8s}" for c in cols))
for k in sorted(g):
    tot_ms = sum(r["step"] for r in g[k]); tot_c = sum(r["committed"] for r in g[k]); tot_d = sum(r["drafts"] for r in g[k])
    print(f"   {k}: total {tot_ms:.0f} ms, {tot_c} tokens, {tot_c/tot_ms:.3f} tok/ms, drafts {tot_d}")
    print(f"{k:14s} {len(g[k]):4d} " + " ".join(f"{statistics.median(r[c] for r in g[k]):8.2f}" for c in cols))
if args.out:
    json.dump(dict(args=vars(args), wall=wall, rows=rows, decisions=decisions), open(args.out, "w"), default=str)

snap = d.drafter.acceptance_snapshot()
for src, v in snap.items():
    print(src, {k: [round(x, 3) for x in vals[:6]] for k, vals in v.items()})
shutdown_llm(llm)
