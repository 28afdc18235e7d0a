"""Memory rows of processed requests: the rows a penalised or sampled request will be drafted
against, not the raw model's.

Tree steps of a request with penalties or a temperature already store their nodes' processed
top-K (:mod:`~vllm_recap.vllm.tree_verify`). Its other rows did not: prompt rows seeded at
prefill and the rows of steps without a tree (a chain, or no drafts). Those stored the raw
model's top-K, and drafts read from them proposed the raw argmax where the processed one
differs. Under Qwen2.5-VL's recommended settings (repetition penalty 1.05, greedy-equivalent)
that is common: on 26 Spec-Bench prompts x 128 tokens (SmolLM2, float32) the penalty moved
the argmax away from the raw one at 8.9% of the generated positions -- each time away from a
token the prompt or the answer already holds (a penalty only lowers those), the tokens a
copying draft proposes.

Here those rows of greedy-equivalent requests with penalties are processed as their tree
rows are (:func:`candidate_memory_rows`: the raw top-K candidates penalised over the request's
prompt + output + the row's path, ranked as greedy). Measured (26 Spec-Bench prompts x 128
tokens, Qwen2.5-VL's settings, fixed 8 nodes, SmolLM2, bf16, deterministic): 1.657 -> 1.674
tokens per pass. Sampled requests keep raw rows outside their trees: dividing seed rows by the
temperature as well moved Qwen2.5 text settings from 1.513 to 1.472 tokens per pass in one
seeded run, within what one sampled run resolves, so it was left out.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from vllm_recap.vllm.token_history import TokenHistory
from vllm_recap.vllm.tree_sampling import RequestSampling, candidate_memory_rows
from vllm_recap.vllm.verifier import rows_values


def memory_state(params, prompt_token_ids: Sequence[int] | None,
                 output_token_ids: Sequence[int],
                 history: TokenHistory | None = None) -> RequestSampling | None:
    """The state its memory rows are processed with: greedy-equivalent requests with
    penalties, ranked as greedy (as their trees' rows). None keeps the raw model's rows: plain
    greedy requests, sampled ones (see above), and requests with nothing that moves a row's
    ranking (masks and top-k/top-p cuts are not applied to memory rows; without a prompt no
    repetition penalty can be computed). ``history``: the request's, kept between steps."""
    if params is None or (prompt_token_ids is None and params.repetition_penalty != 1.0):
        return None
    rs = RequestSampling.from_params(params, prompt_token_ids, output_token_ids)
    if not rs.greedy_equivalent or not rs.has_penalties:
        return None
    if history is not None:
        history.sync(prompt_token_ids, output_token_ids)
    return replace(rs, temperature=0.0, history=history)  # the argmax decides


def process_rows(logits: torch.Tensor, rows: np.ndarray, ids: np.ndarray, probs: np.ndarray,
                 state: RequestSampling, paths: Sequence[Sequence[int]]) -> None:
    """Replaces some memory rows by their processed form, in place.

    Args:
        logits: [R, V] the logits the rows came from.
        rows: [M] int64 indices of the rows to process (into ``logits``, ``ids``, ``probs``).
        ids: [R, K] raw top-K ids, largest first (:func:`~vllm_recap.vllm.verifier.topk_rows`).
        probs: [R, K] float32 their softmax.
        state: the request's state (:func:`memory_state`).
        paths: [M] per row, the draft tokens on its path (root excluded; () for the root row).
    """
    if len(rows) == 0:
        return
    cand = ids[rows]
    values = rows_values(logits, rows, cand)
    new_ids, new_probs = candidate_memory_rows(values, cand, np.zeros(len(rows), np.int64),
                                               paths, [state])
    ids[rows], probs[rows] = new_ids, new_probs
