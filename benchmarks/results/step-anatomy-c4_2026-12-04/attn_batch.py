import sys, time, statistics, torch
from types import SimpleNamespace
sys.path.insert(0, "/work/main")
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
dtype = torch.bfloat16
h, kvh, hs, bs = 9, 3, 64, int(sys.argv[1]) if len(sys.argv) > 1 else 128
ctx = 400
isa = _get_attn_isa(dtype, bs, hs, "auto")
print("isa", isa, "threads", torch.get_num_threads(), "bs", bs)
def case(qlens, nreq_ctx=ctx):
    n = len(qlens)
    nblk_per = -(-(nreq_ctx + max(qlens)) // bs)
    kv = torch.randn(n * nblk_per, kvh, bs, 2 * hs).to(dtype)
    kc, vc = kv.view(n * nblk_per, kvh, bs * 2, hs).chunk(2, dim=2)
    T = sum(qlens)
    q = torch.randn(T, h, hs).to(dtype)
    out = torch.empty(T, h * hs, dtype=dtype)
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32)
    sl = torch.tensor([nreq_ctx + x for x in qlens], dtype=torch.int32)
    bt = torch.arange(n * nblk_per, dtype=torch.int32).view(n, nblk_per)
    def sched():
        return ops.cpu_attn_get_scheduler_metadata(num_reqs=n, num_heads=h, num_kv_heads=kvh, head_dim=hs, seq_lens=sl,
            dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=True)
    sm = sched()
    def run():
        ops.cpu_attention_with_kv_cache(query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl,
            seq_lens=sl, scale=hs ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=bt,
            softcap=0, scheduler_metadata=sm, s_aux=None)
    return run, sched
cases = {"4x1": [1,1,1,1], "5x1": [1,1,1,1,1], "2,1,1,1": [2,1,1,1], "5,1,1,1": [5,1,1,1], "2,2,2,2": [2,2,2,2], "3,3,3,3": [3,3,3,3], "8x1": [1]*8}
fns = {k: case(v) for k, v in cases.items()}
evict = torch.zeros(8 << 20)
samples = {k: [] for k in cases}; ss = {k: [] for k in cases}
for rep in range(300):
    for k, (run, sched) in fns.items():
        evict.add_(1)
        t = time.perf_counter_ns(); run(); samples[k].append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns(); sched(); ss[k].append(time.perf_counter_ns() - t)
for k in cases:
    print(f"{k:10s} kernel {statistics.median(samples[k])/1e3:7.1f} us  sched {statistics.median(ss[k])/1e3:6.1f} us  (x30 layers: {statistics.median(samples[k])*30/1e6:.2f} ms)")
