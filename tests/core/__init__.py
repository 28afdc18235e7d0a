"""Tests of vllm_recap.core (engine-free)."""
