"""The speculative methods the benchmark compares, as vLLM ``speculative_config`` dicts."""
from __future__ import annotations

# vLLM's documented n-gram example (docs/features/speculative_decoding/n_gram.md).
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}

METHODS: dict[str, dict | None] = {
    "none": None,
    "ngram": NGRAM,
    "recap-chain": {"method": "recap", "draft_mode": "chain"},
    "recap-tree": {"method": "recap"},
}


def method_config(name: str) -> dict | None:
    """The speculative_config for a method name; ValueError listing the known names otherwise."""
    if name not in METHODS:
        raise ValueError(f"Unknown method {name!r}; known methods: {', '.join(METHODS)}")
    config = METHODS[name]
    return dict(config) if config is not None else None
