"""Penalised candidates of tree rows, in compiled code: vLLM's float32 ops on a few entries.

A greedy-equivalent request with a repetition penalty (Qwen2.5-VL's recommended settings) has
every tree row decided from the row's raw top K: the K candidates are penalised as vLLM's
CPU sampler would penalise them, ranked, and the best is the row's argmax when it stays above
the K-th raw value (see ``vllm_recap.vllm.tree_sampling.penalised_top_argmax``). In numpy
that was ~35 calls on [rows, K] arrays a step, each paying several times its warm cost right
after the forward pass has streamed the weights through the caches (0.28 ms p50 a step at
batch 1, bf16 SmolLM2, against ~0.06 ms for the whole acceptance of plain greedy trees).
Here it is two compiled calls.

No torch, no vLLM: callers pass numpy arrays.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from vllm_recap.core.candidates import descending_order


@njit(cache=True, nogil=True, boundscheck=False)
def _penalise_group(v, ids, rows, out_counts, prompt, path, rep, freq, pres):  # pragma: no cover
    """vLLM's penalties on the candidates of one request's rows, in place.

    For each row ``rows[i]`` and candidate q: the count is the output count plus the token's
    occurrences on the row's path; the token is "seen" when counted or in the prompt
    (``prompt`` sorted). Then, in float32 and vLLM's CPU order: x * (1 / r) for x > 0 else
    x * r where seen; x - f * count; x - p * (count > 0).
    """
    one = np.float32(1.0)
    zero = np.float32(0.0)
    inv = one / rep
    k = ids.shape[1]
    depth = path.shape[1]
    n_prompt = prompt.shape[0]
    for i in range(rows.shape[0]):
        r = rows[i]
        for q in range(k):
            tok = ids[r, q]
            c = out_counts[i, q]
            for d in range(depth):
                if path[i, d] == tok:
                    c += 1
            seen = c > 0
            if not seen and n_prompt > 0:
                at = np.searchsorted(prompt, tok)
                seen = at < n_prompt and prompt[at] == tok
            x = v[r, q]
            if seen:
                x = x * (inv if x > zero else rep)
            x = x - freq * np.float32(c)
            x = x - pres * (one if c > 0 else zero)
            v[r, q] = x


def penalise_group(v: np.ndarray, ids: np.ndarray, rows: np.ndarray, out_counts: np.ndarray,
                   prompt: np.ndarray, path: np.ndarray, repetition: float, frequency: float,
                   presence: float) -> None:
    """Penalises one request's candidate rows of ``v`` in place.

    Args:
        v: [M, K] float32 candidate logits (all requests' rows), modified at ``rows``.
        ids: [M, K] int64 their token ids.
        rows: [G] int64 the request's rows.
        out_counts: [G, K] int64 each candidate's count in the request's committed output.
        prompt: [P] int64 the prompt's distinct tokens, sorted.
        path: [G, D] int64 each row's path tokens (root excluded, node included), -1 padded.
        repetition, frequency, presence: the request's penalties (applied as float32).
    """
    _penalise_group(v, ids, rows, out_counts, prompt, path, np.float32(repetition),
                    np.float32(frequency), np.float32(presence))


@njit(cache=True, nogil=True, boundscheck=False)
def _rank(v, ids, raw_last, mem_ids, mem_vals, probs, argmax):  # pragma: no cover - compiled
    """Per row: candidates by value, largest first (stable: equal values keep their order),
    the softmax over them (float64, stored float32), the lowest id among the maxima; returns
    whether every row's maximum is above its ``raw_last``."""
    m, k = v.shape
    order = np.empty(k, np.int64)
    decided = True
    for r in range(m):
        descending_order(v[r], order)
        for q in range(k):
            mem_ids[r, q] = ids[r, order[q]]
            mem_vals[r, q] = v[r, order[q]]
        best = mem_vals[r, 0]
        a = mem_ids[r, 0]
        for q in range(1, k):
            if mem_vals[r, q] == best and mem_ids[r, q] < a:
                a = mem_ids[r, q]
        argmax[r] = a
        if not best > raw_last[r]:
            decided = False
        total = 0.0
        for q in range(k):
            e = np.exp(np.float64(mem_vals[r, q]) - np.float64(best))
            probs[r, q] = e
            total += e
        for q in range(k):
            probs[r, q] = probs[r, q] / total
    return decided


def rank_candidates(v: np.ndarray, ids: np.ndarray, raw_last: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, bool]:
    """Each row's candidates ranked by value.

    Args:
        v: [M, K] float32 processed candidate values.
        ids: [M, K] int64 their token ids.
        raw_last: [M] float32 a bound per row (the K-th raw value); None: no bound.

    Returns:
        ids [M, K] int64 and values [M, K] float32 by value, largest first (equal values in
        their given order), probs [M, K] float32 (the softmax over the K values), argmax [M]
        int64 (the lowest id among each row's maxima: vLLM's greedy rule), and whether every
        row's maximum is above its ``raw_last`` (True without one).
    """
    v = np.ascontiguousarray(v, np.float32)
    ids = np.ascontiguousarray(ids, np.int64)
    m, k = v.shape
    mem_ids = np.empty((m, k), np.int64)
    mem_vals = np.empty((m, k), np.float32)
    probs = np.empty((m, k), np.float32)
    argmax = np.empty(m, np.int64)
    bound = (np.full(m, -np.inf, np.float32) if raw_last is None
             else np.ascontiguousarray(raw_last, np.float32))
    decided = bool(_rank(v, ids, bound, mem_ids, mem_vals, probs, argmax))
    return mem_ids, mem_vals, probs, argmax, decided


def warmup() -> None:
    """Compiles (or loads from numba's cache) the kernels."""
    v = np.array([[2.0, 1.0, -1.0]], np.float32)
    ids = np.array([[3, 1, 2]], np.int64)
    penalise_group(v, ids, np.zeros(1, np.int64), np.zeros((1, 3), np.int64),
                   np.array([1], np.int64), np.full((1, 1), -1, np.int64), 1.05, 0.0, 0.0)
    rank_candidates(v, ids, np.zeros(1, np.float32))
