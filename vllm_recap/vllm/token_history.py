"""A request's prompt and output tokens in the form penalties read them, kept between steps.

Penalising a step's candidates (:func:`~vllm_recap.vllm.tree_sampling.penalise_candidates`)
asks, per candidate token: is it in the prompt, and how often is it in the output? Answered
from vLLM's token lists afresh, every step converted the prompt list to an array and sorted it
(``np.isin``) and sorted the output (``np.unique``), once per request. Here the prompt is
sorted once per request and the output counted as it grows. Measured under Qwen2.5-VL's
settings (Spec-Bench prompts of up to ~1,500 tokens, bf16 SmolLM2, 2-core EPYC): the penalised
walk of a step took 0.55 -> 0.36 ms p50 at batch 1 and 0.75 -> 0.43 ms at concurrency 4.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenHistory:
    """Distinct prompt tokens (sorted) and output token counts of one request.

    :meth:`sync` brings it up to date with vLLM's lists; it consumes the output up to the
    first negative entry (an async-scheduling placeholder, left out of the penalties as vLLM
    leaves it out) and counts whatever follows afresh on each lookup. vLLM edits a request's
    output list in place -- appends, placeholders filled in, ``del`` of a tail after a failed
    KV load or an optimistic async extend, ``clear`` -- and replaces its prompt list (streaming
    sessions): a prompt list that is not the one sorted, or an output whose first consumed
    tokens are not the ones counted, is read again from the start. Checking the consumed
    prefix is one list comparison in C (~10 us at 2,000 tokens).
    """

    def __init__(self) -> None:
        self._prompt_list: Sequence[int] | None = None
        self._prompt_len = -1
        self._prompt = np.zeros(0, np.int64)
        self._counts: dict[int, int] = {}
        self._consumed: list[int] = []
        self._tail: list[int] = []

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Brings the history up to date with the request's current token lists."""
        if prompt is not self._prompt_list or len(prompt) != self._prompt_len:
            self._prompt = np.unique(np.asarray(prompt, np.int64).reshape(-1))
            self._prompt_list, self._prompt_len = prompt, len(prompt)
        if not isinstance(output, list):  # a list's prefix compares with the consumed one
            output = list(output)
        done = len(self._consumed)
        if output[:done] != self._consumed:
            self._counts, self._consumed, done = {}, [], 0
        counts = self._counts
        i, n = done, len(output)
        while i < n and output[i] >= 0:
            counts[output[i]] = counts.get(output[i], 0) + 1
            i += 1
        self._consumed.extend(output[done:i])
        self._tail = [t for t in output[i:] if t >= 0]

    @property
    def prompt_tokens(self) -> np.ndarray:
        """[P] int64 the prompt's distinct tokens, sorted."""
        return self._prompt

    def output_counts(self, tokens: np.ndarray) -> np.ndarray:
        """[...] int64: occurrences of each token in the output (``tokens`` int64, any shape)."""
        get = self._counts.get
        flat = tokens.reshape(-1).tolist()
        out = np.fromiter((get(t, 0) for t in flat), np.int64, len(flat)).reshape(tokens.shape)
        for t in self._tail:
            out += tokens == t
        return out
