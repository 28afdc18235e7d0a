"""Translation of ``{"method": "recap", ...}`` into what vLLM's SpeculativeConfig accepts.

Every key other than ``method`` and vLLM's own ``num_speculative_tokens`` is a RECAP knob
(:class:`vllm_recap.core.config.RecapConfig`); unknown keys and bad values raise ValueError
before any engine starts. Defaults that depend on the hardware are filled in here: the node
budget is the paper's 63 on a GPU and a measured smaller value on a CPU, where verifying
extra tokens is not nearly free (see README, "Choosing the node budget").
"""
from __future__ import annotations

from typing import Any

from vllm_recap.core.config import DraftMode, RecapConfig
from vllm_recap.vllm import PROPOSER_PATH

# vLLM SpeculativeConfig keys that keep their vLLM meaning with method "recap".
VLLM_KEYS = ("num_speculative_tokens",)

# Hardware defaults for knobs the user did not set (measured: benchmarks/results/).
# Prompt seeding is off on a CPU: there each seeded row costs real LM-head work (SmolLM2 in
# float32 on an AVX2-only CPU ~0.65 ms a row, 38-75 ms a request) and the rows now buy next to
# nothing beside the continuations and the shared index -- at a fixed 8 nodes, greedy float32,
# 26 Spec-Bench prompts x 128, seeding took 9-12 of 1655 passes off SmolLM2's run (0.5-0.7%),
# 2 of 1867 under Qwen2.5-VL's settings, none of Gemma-3-270M's 341 (13 x 96) -- while its
# steps were every p99 step of RECAP's own work (`cpu-seeding-off_2026-12-07/`). On a device
# the rows ride along with the step's LM-head call for next to nothing, so it stays on.
DEVICE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"node_budget": 16, "batch_node_budget": 64, "prompt_seed_rows": 0},
    "cuda": {"node_budget": 63, "batch_node_budget": 1024},
}


# vLLM's rejection sampler asserts at most this many draft tokens per request and step
# (vllm/v1/sample/rejection_sampler.py MAX_SPEC_LEN in 0.32 and 0.33).
VLLM_MAX_DRAFTS = 128


def translate(spec: dict[str, Any], device: str = "cpu", pipeline_parallel_size: int = 1
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Validates a RECAP speculative config and returns (vLLM config, RECAP options).

    Args:
        spec: the user's dict, ``method`` == "recap".
        device: "cpu" or "cuda", for hardware defaults.
        pipeline_parallel_size: the engine's; RECAP needs every layer's attention on one rank.

    Returns:
        ``{"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": n}`` and
        the full RECAP option dict (``RecapConfig.to_dict()``) for ``additional_config``.

    Raises:
        ValueError: unknown key (the message lists the valid ones), a bad value (field,
            value and allowed range), more drafts per request than vLLM verifies, or
            pipeline parallelism.
    """
    if pipeline_parallel_size > 1:
        raise ValueError(
            f"speculative method 'recap' does not support pipeline parallelism "
            f"(pipeline_parallel_size = {pipeline_parallel_size}): tree verification needs every "
            "attention layer of a step on one rank. Use tensor parallelism, or an engine "
            "without speculative decoding.")
    knobs = {k.replace("-", "_"): v for k, v in spec.items() if k != "method"}
    valid = RecapConfig.field_names()
    unknown = sorted(k for k in knobs if k not in valid and k not in VLLM_KEYS)
    if unknown:
        raise ValueError(
            f"Unknown key(s) {unknown} in speculative_config for method 'recap'. Valid keys: "
            f"{', '.join(sorted(valid + list(VLLM_KEYS)))}.")
    vllm_part = {k: knobs.pop(k) for k in VLLM_KEYS if k in knobs}
    for key, value in DEVICE_DEFAULTS.get(device, DEVICE_DEFAULTS["cuda"]).items():
        knobs.setdefault(key, value)
    config = RecapConfig.from_dict(knobs)
    needed = max_drafts(config)
    n = vllm_part.get("num_speculative_tokens", needed)
    if "num_speculative_tokens" not in vllm_part and needed > VLLM_MAX_DRAFTS:
        raise ValueError(
            f"speculative_config asks for up to {needed} draft tokens per request "
            f"(node_budget {config.node_budget} + suffix_len {config.suffix_len}), but vLLM "
            f"verifies at most {VLLM_MAX_DRAFTS}: lower node_budget, or set "
            f"num_speculative_tokens <= {VLLM_MAX_DRAFTS} to cap the drafts.")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= VLLM_MAX_DRAFTS:
        raise ValueError(
            f"speculative_config num_speculative_tokens = {n!r} is out of range: must be an int "
            f"in [1, {VLLM_MAX_DRAFTS}] (it caps RECAP's draft nodes per request; vLLM verifies "
            f"at most {VLLM_MAX_DRAFTS}; default {needed}).")
    return ({"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": n},
            config.to_dict())


def max_drafts(config: RecapConfig) -> int:
    """Most draft tokens one request can propose in a step with this config."""
    if config.draft_mode is DraftMode.CHAIN:
        return config.max_depth
    return max(1, config.node_budget + config.suffix_len)
