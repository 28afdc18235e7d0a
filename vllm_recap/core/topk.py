"""Top-K of float rows read as integers: one compiled, single-threaded pass per row.

Every verified step needs the top-K ids of R logits rows (R = 1 + drafts per request) over
the whole vocabulary, tree steps need their argmax, and prompt seeding the top-K of up to 128
rows. With torch on a 2-core CPU that cost 0.3-0.5 ms a step at batch 1 (SmolLM2, bfloat16):
bfloat16 reductions convert every value to float32, and each small op pays a wake-up of the
intra-op thread pool that went to sleep while Python ran (measured: the first reduction after
a 2 ms pause costs twice the next one). Here the rows are read as integers instead:

- An IEEE float's bits order like the float among non-negative values and in reverse among
  negative ones. So ``key(b) = b ^ ((b >> (w - 1)) & (2**(w-1) - 1))`` of the w-bit pattern
  b orders exactly as the floats do (``-0.0`` is mapped onto ``+0.0``'s key, so equal floats
  have equal keys). bfloat16 and float16 rows are scanned as int16, float32 rows as int32.
- Pass 1 keeps the largest and smallest bit pattern of every chunk of ``CHUNK`` entries (a
  loop LLVM vectorises: ~2 us per 49k-wide int16 row); a chunk's maximum is its largest
  pattern when that is non-negative, else its smallest.
- The K largest entries lie in the K chunks with the largest maxima (each is its chunk's
  maximum or below one of those maxima), so pass 2 searches only those K chunks.

Ties: chunks with equal maxima are taken lowest first, and within the searched chunks equal
values keep the lower id first; so the top-1 is the lowest id among the row's maxima, which
is vLLM's greedy rule (``argmax``). NaN logits do not occur in a working model (they would
sort as the largest or smallest values).

No torch here: callers pass numpy views of the rows' storage (``t.view(torch.int16).numpy()``).
"""
from __future__ import annotations

import numpy as np
from numba import njit

CHUNK = 128


@njit(cache=True, nogil=True, boundscheck=False)
def _topk_bits(bits, width, k, chunk, out_ids, out_bits):  # pragma: no cover - compiled
    """Per row of ``bits`` [R, V] (``width``-bit floats): the k largest entries' ids and bit
    patterns, largest first, into ``out_ids`` [R, k] int64 and ``out_bits`` [R, k]."""
    rows, vocab = bits.shape
    n_chunks = (vocab + chunk - 1) // chunk
    top = width - 1
    mask = (1 << top) - 1
    maxima = np.empty(n_chunks, np.int64)
    best_chunks = np.empty(k, np.int64)
    best_max = np.empty(k, np.int64)
    keys = np.empty(k, np.int64)
    for r in range(rows):
        row = bits[r]
        # pass 1: largest / smallest pattern per chunk (same-typed selects: vectorised)
        for c in range(n_chunks):
            start = c * chunk
            end = min(vocab, start + chunk)
            high = row[start]
            low = row[start]
            for j in range(start + 1, end):
                v = row[j]
                high = v if v > high else high
                low = v if v < low else low
            b = np.int64(high) if high >= 0 else np.int64(low)
            key = b ^ ((b >> top) & mask)
            maxima[c] = 0 if key == -1 else key  # -0.0 == +0.0
        # the k chunks with the largest maxima, lowest chunk first among equal maxima
        n_best = 0
        for c in range(n_chunks):
            m = maxima[c]
            if n_best == k and m <= best_max[k - 1]:
                continue
            pos = min(n_best, k - 1)
            while pos > 0 and best_max[pos - 1] < m:
                best_max[pos] = best_max[pos - 1]
                best_chunks[pos] = best_chunks[pos - 1]
                pos -= 1
            best_max[pos] = m
            best_chunks[pos] = c
            n_best = min(n_best + 1, k)
        # pass 2: the exact top k within those chunks, lower id first among equal values
        n_top = 0
        ids = out_ids[r]
        for q in range(n_best):
            start = best_chunks[q] * chunk
            end = min(vocab, start + chunk)
            for j in range(start, end):
                b = np.int64(row[j])
                key = b ^ ((b >> top) & mask)
                if key == -1:
                    key = 0
                if n_top == k and (key < keys[k - 1] or (key == keys[k - 1] and j > ids[k - 1])):
                    continue
                pos = min(n_top, k - 1)
                while pos > 0 and (keys[pos - 1] < key or (keys[pos - 1] == key
                                                           and ids[pos - 1] > j)):
                    keys[pos] = keys[pos - 1]
                    ids[pos] = ids[pos - 1]
                    pos -= 1
                keys[pos] = key
                ids[pos] = j
                n_top = min(n_top + 1, k)
        for q in range(k):
            out_bits[r, q] = row[ids[q]]


def topk_bits(bits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-K of float rows given as their bit patterns.

    Args:
        bits: [R, V] int16 (bfloat16 / float16 rows) or int32 (float32 rows).
        k: entries kept per row, 1 <= k <= V.

    Returns:
        ids [R, k] int64, largest value first (equal values: lower id first), and the bit
        patterns [R, k] of those entries (same dtype as ``bits``; the caller reinterprets them
        as its floats).
    """
    if bits.ndim != 2 or bits.dtype not in (np.int16, np.int32):
        raise TypeError(f"topk_bits: expected [R, V] int16 or int32, got {bits.dtype} "
                        f"of shape {bits.shape}")
    rows, vocab = bits.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"topk_bits: k = {k} outside [1, {vocab}]")
    ids = np.empty((rows, k), np.int64)
    out = np.empty((rows, k), bits.dtype)
    if rows:
        _topk_bits(np.ascontiguousarray(bits), bits.dtype.itemsize * 8, k, CHUNK, ids, out)
    return ids, out


def warmup() -> None:
    """Compiles (or loads from numba's cache) both specialisations."""
    for dtype in (np.int16, np.int32):
        topk_bits(np.arange(-300, 300, dtype=dtype).reshape(2, 300), 3)
