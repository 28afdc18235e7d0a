"""RECAP core: memories, fusion, tree builder, suffix automaton, verification. No vllm/torch."""
