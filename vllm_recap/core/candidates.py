"""Sampled tree rows from their largest logits: temperature, vLLM's top-k / top-p rules and one
inverse-CDF draw per row, in one compiled call.

A sampled row under Qwen2.5's text settings (T 0.7, top_k 20, top_p 0.8) is decided by its
largest logits (``vllm_recap.vllm.candidate_walk``): when the k-th largest processed candidate
is above every entry outside them, nothing else survives vLLM's top-k, and top-p runs over the
survivors alone. In torch that was ~25 small calls on [rows, C] tensors a step (0.47 ms p50 at
batch 1, bf16 SmolLM2, 0.31 of it the filter), each paying several times its warm cost right
after the forward pass. Here it is one pass per row over its C candidates.

The rules are vLLM's (``apply_top_k_top_p_pytorch``, as ``vllm_recap.vllm.top_k_top_p``
replays them): top-k keeps every candidate at or above the k-th largest; top-p takes the
softmax over the survivors and masks each survivor (the largest never) whose mass together
with every smaller survivor's is at most 1 - p. Float32 throughout, as vLLM's; sums run in
another order than torch's, so a row whose cumulative mass lies within ``CUT_MARGIN`` of the
cut, a tie across the cut, a tie running past the candidates taken, or a non-finite k-th value
is left undecided, and the caller processes it whole with vLLM's own function.

No torch, no vLLM.
"""
from __future__ import annotations

import numpy as np
from numba import njit

# A cumulative mass this close to the top-p cut is left to vLLM's own function (its sums run
# over the whole row in another order; float32 over <= 1024 terms differs by < 1e-4).
CUT_MARGIN = 1e-4


@njit(cache=True, nogil=True, boundscheck=False)
def _sample_rows(vals, ids, rest, temp, k, p, use_p, uniforms, x, drawn,
                 exact):  # pragma: no cover - compiled
    """Per row: x = vals / T, the top-k / top-p mask (-inf), the draw; see the module."""
    rows, width = vals.shape
    inf = np.float32(np.inf)
    one = np.float32(1.0)
    zero = np.float32(0.0)
    margin = np.float32(CUT_MARGIN)
    probs = np.empty(width, np.float32)
    tail = np.empty(width, np.float32)
    keep = np.empty(width, np.bool_)
    order = np.empty(width, np.int64)
    for r in range(rows):
        t = temp[r]
        for j in range(width):
            x[r, j] = vals[r, j] / t  # vLLM's apply_temperature: float32 division
        bound = rest[r] / t
        kth = x[r, k[r] - 1]
        ok = kth > -inf and kth < inf and bound < kth
        for j in range(width):
            keep[j] = x[r, j] >= kth
        if use_p:
            # softmax over the survivors (largest first), then each survivor's mass together
            # with every smaller one's, summed from the smallest as vLLM's ascending cumsum
            top = x[r, 0]
            total = zero
            for j in range(width):
                probs[j] = np.exp(x[r, j] - top) if keep[j] else zero
                total += probs[j]
            acc = zero
            for j in range(width - 1, -1, -1):
                probs[j] = probs[j] / total
                acc += probs[j]
                tail[j] = acc
            cut = one - p[r]
            for j in range(1, width):
                if keep[j] and abs(tail[j] - cut) <= margin:
                    ok = False  # too close to the cut to be sure of vLLM's rounding
            dropped_prev = False
            for j in range(width):
                drop = keep[j] and j > 0 and tail[j] <= cut
                if j > 0 and drop != dropped_prev and keep[j] and x[r, j - 1] == x[r, j]:
                    ok = False  # a tie across the cut: vLLM's sort order decides
                dropped_prev = drop
                if drop:
                    keep[j] = False
        exact[r] = ok
        for j in range(width):
            if not keep[j]:
                x[r, j] = -inf
        # the softmax over the kept candidates, read in token-id order: the whole row's
        # inverse CDF at the candidates (masked entries have no mass)
        top = x[r, 0]
        total = zero
        for j in range(width):
            probs[j] = np.exp(x[r, j] - top) if keep[j] else zero
            total += probs[j]
        order[:] = np.argsort(ids[r], kind="mergesort")
        mass = tail  # reused: each candidate's probability, in token-id order
        total_by_id = zero
        for j in range(width):
            mass[j] = probs[order[j]] / total
            total_by_id += mass[j]
        u = uniforms[r] * total_by_id  # as sample_rows: the uniform scaled to the cdf's end
        cdf = zero
        picked = -1
        for j in range(width):
            cdf += mass[j]
            if cdf > u:
                picked = j
                break
        if picked < 0:  # u rounded up to the total: the last candidate with mass
            for j in range(width - 1, -1, -1):
                if mass[j] > zero:
                    picked = j
                    break
        drawn[r] = ids[r, order[picked]]


def sample_candidates(vals: np.ndarray, ids: np.ndarray, rest: np.ndarray, temp: np.ndarray,
                      k: np.ndarray, p: np.ndarray | None, uniforms: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Temperature, top-k / top-p and one draw for sampled rows given by their candidates.

    Args:
        vals: [S, C] float32 each row's C largest (penalised) logits, descending.
        ids: [S, C] int64 their token ids.
        rest: [S] float32 an upper bound of every logit of the row outside the candidates.
        temp: [S] float32 temperatures; k: [S] int64 top-k in 1..C.
        p: [S] float32 top-p per row, or None (vLLM without a top-p tensor: top-k only).
        uniforms: [S] float32 one uniform draw in [0, 1) per row.

    Returns:
        x [S, C] float32 processed candidates (-inf where masked), drawn [S] int64 token ids
        (inverse CDF in token-id order), exact [S] bool (decided here; elsewhere both mean
        nothing and the row must be processed whole).
    """
    vals = np.ascontiguousarray(vals, np.float32)
    ids = np.ascontiguousarray(ids, np.int64)
    rows, width = vals.shape
    x = np.empty((rows, width), np.float32)
    drawn = np.empty(rows, np.int64)
    exact = np.empty(rows, np.bool_)
    use_p = p is not None
    _sample_rows(vals, ids, np.ascontiguousarray(rest, np.float32),
                 np.ascontiguousarray(temp, np.float32), np.ascontiguousarray(k, np.int64),
                 np.ascontiguousarray(p if use_p else np.ones(rows), np.float32), use_p,
                 np.ascontiguousarray(uniforms, np.float32).reshape(-1), x, drawn, exact)
    return x, drawn, exact


@njit(cache=True, nogil=True, boundscheck=False)
def descending_order(row, order):  # pragma: no cover - compiled
    """``order[:len(row)]`` = the positions of ``row`` by value, largest first, stably (equal
    values keep their order): an insertion sort, each entry after every one at or above it
    (rows of a few dozen candidates). Compiled code calling this is cached by numba with its
    own module: clear ``__pycache__`` after changing it."""
    for j in range(row.shape[0]):
        v = row[j]
        pos = j
        while pos > 0 and row[order[pos - 1]] < v:
            order[pos] = order[pos - 1]
            pos -= 1
        order[pos] = j


@njit(cache=True, nogil=True, boundscheck=False)
def _descending(vals, ids, out_vals, out_ids):  # pragma: no cover - compiled
    """Each row of ``vals`` [M, C] in descending order, stably (equal values keep their
    order), with its ``ids``: numpy's stable argsort of ``-vals`` and two gathers."""
    rows, width = vals.shape
    order = np.empty(width, np.int64)
    for r in range(rows):
        descending_order(vals[r], order)
        for j in range(width):
            out_vals[r, j] = vals[r, order[j]]
            out_ids[r, j] = ids[r, order[j]]


def descending(vals: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows sorted by value, largest first, stably, with their ids.

    Args:
        vals: [M, C] float32 (no NaN); ids: [M, C] int64.

    Returns:
        [M, C] float32 values and [M, C] int64 ids, as ``np.argsort(-vals, axis=1,
        kind="stable")`` would order them.
    """
    vals = np.ascontiguousarray(vals, np.float32)
    out_vals = np.empty_like(vals)
    out_ids = np.empty(vals.shape, np.int64)
    _descending(vals, np.ascontiguousarray(ids, np.int64), out_vals, out_ids)
    return out_vals, out_ids


@njit(cache=True, nogil=True, boundscheck=False)
def _memory_rows(vals, ids, k, out_vals, out_ids):  # pragma: no cover - compiled
    """Per row of ``vals`` / ``ids`` [M, C]: the k best by (value descending, id ascending),
    then masked entries' ids replaced by the lowest ids the row did not keep."""
    rows, width = vals.shape
    order = np.empty(width, np.int64)
    for r in range(rows):
        for j in range(width):
            v, t = vals[r, j], ids[r, j]
            pos = j
            while pos > 0:
                pv, pt = vals[r, order[pos - 1]], ids[r, order[pos - 1]]
                if pv > v or (pv == v and pt < t):
                    break
                order[pos] = order[pos - 1]
                pos -= 1
            order[pos] = j
        live = 0
        for q in range(k):
            out_vals[r, q] = vals[r, order[q]]
            out_ids[r, q] = ids[r, order[q]]
            if np.isfinite(out_vals[r, q]):
                live += 1
        q, t = live, 0
        while q < k:  # masked entries rank last: the lowest ids not among the live ones
            kept = False
            for a in range(live):
                if out_ids[r, a] == t:
                    kept = True
                    break
            if not kept:
                out_ids[r, q] = t
                q += 1
            t += 1


def memory_rows(vals: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Memory rows of processed candidates, as ``topk_rows`` takes them from whole processed
    rows: by value, equal values lower id first, masked entries (-inf) the lowest ids the row
    did not keep (a whole row's masked entries tie at -inf and rank by id).

    Args:
        vals: [M, C] float32 processed candidates (-inf where masked, no NaN); ids: [M, C]
            int64 their distinct token ids; k: entries kept, <= C.

    Returns:
        [M, k] float32 values and [M, k] int64 ids.
    """
    vals = np.ascontiguousarray(vals, np.float32)
    out_vals = np.empty((vals.shape[0], k), np.float32)
    out_ids = np.empty((vals.shape[0], k), np.int64)
    _memory_rows(vals, np.ascontiguousarray(ids, np.int64), k, out_vals, out_ids)
    return out_vals, out_ids


def warmup() -> None:
    """Compiles (or loads from numba's cache) the kernel."""
    vals = np.array([[3.0, 2.0, 1.0, 0.5]], np.float32)
    ids = np.array([[7, 2, 9, 4]], np.int64)
    for p in (None, np.array([0.8], np.float32)):
        sample_candidates(vals, ids, np.array([0.0], np.float32), np.array([0.7], np.float32),
                          np.array([3]), p, np.array([0.5], np.float32))
    descending(vals, ids)
    memory_rows(vals, ids, 2)
