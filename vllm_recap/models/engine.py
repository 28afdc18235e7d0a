"""Engine settings that make vLLM run on a small CPU-only machine, shared by tests and benchmarks."""
from __future__ import annotations

from typing import Any


def engine_kwargs(
    model: str,
    *,
    dtype: str = "bfloat16",
    kv_cache_mib: int = 512,
    max_model_len: int = 4096,
    speculative_config: dict | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` on this kind of machine.

    - ``kv_cache_memory_bytes``: without an explicit KV budget the CPU worker refuses to start
      (it sizes from the NUMA node's memory).
    - ``enforce_eager``: torch.compile on 2 cores costs minutes per engine start.
    - ``disable_log_stats=False``: speculative-decoding counters reach ``LLM.get_metrics()``.
    """
    kwargs: dict[str, Any] = dict(
        model=model,
        dtype=dtype,
        kv_cache_memory_bytes=kv_cache_mib * 2**20,
        max_model_len=max_model_len,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        speculative_config=speculative_config,
    )
    kwargs.update(overrides)
    return kwargs


def shutdown_llm(llm) -> None:
    """Tear an in-process ``vllm.LLM`` down now, not whenever it is garbage-collected.

    A late collection of an old engine tears down torch.distributed groups that a newer engine
    in the same process is already using ("pipeline model parallel group is not initialized").
    The client's finalizer guard makes a second shutdown (at collection) a no-op.
    """
    import gc

    llm.llm_engine.engine_core.shutdown()
    gc.collect()
