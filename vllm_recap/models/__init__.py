"""Models the tests and benchmarks share: the embedded real models and tiny random ones."""
from vllm_recap.models.gguf import gemma3_path, smollm2_path
from vllm_recap.models.tiny import (
    build_tiny_gemma3,
    build_tiny_qwen2,
    build_tiny_qwen2_vl,
    smollm2_tokenizer_path,
)

EMBEDDED = {"smollm2": smollm2_path, "gemma3": gemma3_path}


def resolve_model(name_or_path: str) -> str:
    """``smollm2`` / ``gemma3`` -> their cached folders; anything else is a local HF folder."""
    if name_or_path in EMBEDDED:
        return str(EMBEDDED[name_or_path]())
    return name_or_path


__all__ = [
    "EMBEDDED", "build_tiny_gemma3", "build_tiny_qwen2", "build_tiny_qwen2_vl", "gemma3_path",
    "resolve_model", "smollm2_path", "smollm2_tokenizer_path",
]
