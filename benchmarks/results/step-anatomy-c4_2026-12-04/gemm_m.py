import time, statistics, torch, sys
from vllm import _custom_ops as ops
from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
from vllm.platforms import current_platform
print("zen", current_platform.is_zen_cpu(), "onednn", ops._supports_onednn)
dtype = torch.bfloat16
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
hs = {}
for name, (N, K) in shapes.items():
    w = torch.randn(N, K).to(dtype)
    print(name, "sgl" if check_cpu_sgl_kernel(N, K, dtype) else "onednn")
    hs[name] = ops.create_onednn_mm(w.t(), 32)
evict = torch.zeros(16 << 20)
Ms = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32]
xs = {M: torch.randn(M, 1536).to(dtype) for M in Ms}
res = {M: [] for M in Ms}
for rep in range(60):
    for M in Ms:
        # one "layer" = the 4 linears; weights for 30 layers do not fit cache: evict
        evict.add_(1)
        t = time.perf_counter_ns()
        for name, (N, K) in shapes.items():
            ops.onednn_mm(hs[name], xs[M][:, :K].contiguous(), None)
        res[M].append(time.perf_counter_ns() - t)
base = statistics.median(res[4])
for M in Ms:
    m = statistics.median(res[M])
    print(f"M={M:3d} layer {m/1e3:7.1f} us  x30 {m*30/1e6:6.2f} ms   vs M=4 {m/base:5.2f}")
