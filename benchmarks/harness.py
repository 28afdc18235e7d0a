"""Runs one method over a list of prompts on a real vLLM engine and records what it did."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from benchmarks.workloads import Prompt

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


@dataclass
class PromptRun:
    """One prompt generated alone (batch 1): output and the spec-decode counter deltas."""

    prompt_id: str
    category: str
    output_ids: list[int]
    seconds: float
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return len(self.output_ids) / self.seconds

    @property
    def target_passes(self) -> int:
        """Forward passes that produced this output: every pass commits 1 + accepted tokens."""
        return len(self.output_ids) - self.accepted_tokens


@dataclass
class MethodRun:
    method: str
    speculative_config: dict | None
    prompts: list[PromptRun] = field(default_factory=list)
    engine_start_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def spec_counters(llm) -> dict[str, int]:
    """Current values of vLLM's speculative-decoding counters (zeros when none are logged)."""
    out = dict.fromkeys(SPEC_COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS and hasattr(metric, "value"):
            out[SPEC_COUNTERS[metric.name]] = int(metric.value)
    return out


def run_method(name: str, speculative_config: dict | None, engine_kwargs: dict,
               prompts: list[Prompt], max_new_tokens: int, progress=None) -> MethodRun:
    """Start an engine for one method, warm it up, then generate each prompt alone, timed."""
    from vllm import LLM, SamplingParams, TokensPrompt

    from vllm_recap.models.engine import shutdown_llm

    t0 = time.perf_counter()
    llm = LLM(**{**engine_kwargs, "speculative_config": speculative_config})
    run = MethodRun(name, speculative_config, engine_start_s=time.perf_counter() - t0)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=False)
    # Warm-up: first calls pay one-off costs (allocator, lazy imports, numba compilation).
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0].token_ids)],
                 SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    try:
        for prompt in prompts:
            before = spec_counters(llm)
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt.token_ids)], params, use_tqdm=False)
            seconds = time.perf_counter() - t
            after = spec_counters(llm)
            delta = {k: after[k] - before[k] for k in after}
            run.prompts.append(PromptRun(prompt.prompt_id, prompt.category,
                                         list(out[0].outputs[0].token_ids), seconds, **delta))
            if progress is not None:
                progress.update(1)
    finally:
        shutdown_llm(llm)
    return run
