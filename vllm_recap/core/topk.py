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
  loop LLVM vectorises: ~2 us per 49k-wide int16 row; see ``_chunk_extremes``); a chunk's
  maximum is its largest pattern when that is non-negative, else its smallest.
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


@njit(cache=True, nogil=True, inline="always")
def _insert(keys, ids, filled, k, key, index):  # pragma: no cover - compiled
    """Inserts (key, index) into the descending lists ``keys``/``ids`` holding ``filled`` of at
    most k entries (equal keys: lower index first); returns the new count."""
    if filled == k and (key < keys[k - 1] or (key == keys[k - 1] and index > ids[k - 1])):
        return filled
    pos = min(filled, k - 1)
    while pos > 0 and (keys[pos - 1] < key or (keys[pos - 1] == key and ids[pos - 1] > index)):
        keys[pos] = keys[pos - 1]
        ids[pos] = ids[pos - 1]
        pos -= 1
    keys[pos] = key
    ids[pos] = index
    return min(filled + 1, k)


@njit(cache=True, nogil=True, boundscheck=False)
def _chunk_extremes(bits, chunk, highs, lows):  # pragma: no cover - compiled
    """The largest and smallest bit pattern of every chunk of ``bits`` [R, V] into ``highs``
    and ``lows`` [R, ceil(V / chunk)].

    Same-typed selects over the raw bits, which LLVM vectorises (~2 us per 49k-wide int16
    row here) -- but, as measured with numba 0.65, only in this form: outputs passed in and
    a chunk-sized allocation inside that is never written (``scratch``). Returning arrays
    allocated here, no allocation, a 1-element one, or writing to ``scratch`` compiled the
    same loop without vectors, ~20x slower (`python -m benchmarks.bench_core` does not cover this; time it with
    ``topk_bits`` on a [17, 49152] int16 array: ~30 us vectorised, ~650 us not)."""
    scratch = np.empty(chunk, bits.dtype)  # noqa: F841 -- keeps the loop vectorised (docstring)
    rows, vocab = bits.shape
    n_full = vocab // chunk
    for r in range(rows):
        for c in range(n_full):
            base = c * chunk
            high = bits[r, base]
            low = bits[r, base]
            for j in range(chunk):
                v = bits[r, base + j]
                high = v if v > high else high
                low = v if v < low else low
            highs[r, c] = high
            lows[r, c] = low
        if vocab > n_full * chunk:  # the partial last chunk
            base = n_full * chunk
            high = bits[r, base]
            low = bits[r, base]
            for j in range(base, vocab):
                v = bits[r, j]
                high = v if v > high else high
                low = v if v < low else low
            highs[r, n_full] = high
            lows[r, n_full] = low


@njit(cache=True, nogil=True, boundscheck=False)
def _topk_bits(bits, width, k, chunk, highs, lows, out_ids, out_bits):  # pragma: no cover
    """Per row of ``bits`` [R, V] (``width``-bit floats), given its chunk extremes: the k
    largest entries' ids and bit patterns, largest first, into ``out_ids`` [R, k] int64 and
    ``out_bits`` [R, k]."""
    rows, vocab = bits.shape
    n_chunks = highs.shape[1]
    top = width - 1
    mask = (1 << top) - 1
    best_chunks = np.empty(k, np.int64)
    best_max = np.empty(k, np.int64)
    keys = np.empty(k, np.int64)
    for r in range(rows):
        row = bits[r]
        # the k chunks with the largest maxima (a chunk's maximum is its largest pattern when
        # that is non-negative, else its smallest), lowest chunk first among equal maxima
        n_best = 0
        for c in range(n_chunks):
            b = np.int64(highs[r, c]) if highs[r, c] >= 0 else np.int64(lows[r, c])
            key = b ^ ((b >> top) & mask)
            n_best = _insert(best_max, best_chunks, n_best, k, 0 if key == -1 else key, c)
        # The exact top k within those chunks, lower id first among equal values. Their k
        # maxima are k entries at or above the k-th best maximum, so an entry below it is
        # not among the top k: only the few at or above it are inserted (for k = 64, a
        # sampled row's candidates, the insertions into a filling list were most of the
        # time: 26 -> 10 us a 49k-wide bfloat16 row).
        floor = best_max[n_best - 1] if n_best == k else np.int64(-(1 << top))
        n_top = 0
        ids = out_ids[r]
        for q in range(n_best):
            start = best_chunks[q] * chunk
            end = min(vocab, start + chunk)
            for j in range(start, end):
                b = np.int64(row[j])
                key = b ^ ((b >> top) & mask)
                key = 0 if key == -1 else key
                if key >= floor:
                    n_top = _insert(keys, ids, n_top, k, key, j)
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
        bits = np.ascontiguousarray(bits)
        n_chunks = -(-vocab // CHUNK)
        highs = np.empty((rows, n_chunks), bits.dtype)
        lows = np.empty((rows, n_chunks), bits.dtype)
        _chunk_extremes(bits, CHUNK, highs, lows)
        _topk_bits(bits, bits.dtype.itemsize * 8, k, CHUNK, highs, lows, ids, out)
    return ids, out


@njit(cache=True, nogil=True, boundscheck=False)
def _softmax_of_bits(top, shift, probs):  # pragma: no cover - compiled
    """Softmax over each row of ``top`` [R, k] (bit patterns of float32 values once shifted
    left by ``shift``: 16 for bfloat16, 0 for float32), largest first, into ``probs``."""
    rows, k = top.shape
    wide = np.empty(k, np.int32)
    values = wide.view(np.float32)
    for r in range(rows):
        for q in range(k):
            wide[q] = np.int32(top[r, q]) << shift
        total = 0.0
        for q in range(k):
            e = np.exp(np.float64(values[q]) - np.float64(values[0]))
            probs[r, q] = e
            total += e
        for q in range(k):
            probs[r, q] = probs[r, q] / total


def topk_probs(bits: np.ndarray, k: int, bfloat16: bool) -> tuple[np.ndarray, np.ndarray]:
    """:func:`topk_bits` of bfloat16 (``bits`` int16, ``bfloat16``) or float32 rows (int32),
    then the softmax over each row's k values, in compiled code.

    One compiled call instead of a torch conversion and four numpy calls: they run right after
    the forward pass has streamed the model's weights through the caches, where each small
    call costs several times its warm time (measured: a softmax over [9, 8] in numpy 64 us
    after a 56 MB bf16 matmul, against a few us warm).

    Returns:
        ids [R, k] int64, largest first (as ``topk_bits``), and probs [R, k] float32.
    """
    if (bits.dtype == np.int16) != bool(bfloat16) or bits.dtype not in (np.int16, np.int32):
        raise TypeError(f"topk_probs: int16 bits are bfloat16 rows, int32 float32 rows; got "
                        f"{bits.dtype} with bfloat16={bfloat16}")
    ids, top = topk_bits(bits, k)
    probs = np.empty(top.shape, np.float32)
    _softmax_of_bits(top, 16 if bfloat16 else 0, probs)
    return ids, probs


@njit(cache=True, nogil=True, boundscheck=False)
def _gather_floats(bits, rows, ids, shift, out):  # pragma: no cover - compiled
    """out[i, q] = the float32 of ``bits[rows[i], ids[i, q]]`` (bit pattern shifted left by
    ``shift``: 16 for bfloat16, 0 for float32)."""
    wide = np.empty(1, np.int32)
    value = wide.view(np.float32)
    for i in range(rows.shape[0]):
        for q in range(ids.shape[1]):
            wide[0] = np.int32(bits[rows[i], ids[i, q]]) << shift
            out[i, q] = value[0]


def gather_floats(bits: np.ndarray, rows: np.ndarray, ids: np.ndarray,
                  bfloat16: bool) -> np.ndarray:
    """Some entries of bfloat16 (``bits`` int16) or float32 (int32) rows, as float32.

    Args:
        bits: [R, V] the rows' bit patterns; rows: [M] int64 row indices; ids: [M, K] int64
            entries per row.

    Returns:
        [M, K] float32, exactly the entries' values (bfloat16 widens exactly).
    """
    if (bits.dtype == np.int16) != bool(bfloat16) or bits.dtype not in (np.int16, np.int32):
        raise TypeError(f"gather_floats: int16 bits are bfloat16 rows, int32 float32 rows; got "
                        f"{bits.dtype} with bfloat16={bfloat16}")
    rows = np.ascontiguousarray(rows, np.int64)
    ids = np.ascontiguousarray(ids, np.int64)
    out = np.empty(ids.shape, np.float32)
    _gather_floats(bits, rows, ids, 16 if bfloat16 else 0, out)
    return out


def warmup() -> None:
    """Compiles (or loads from numba's cache) both specialisations."""
    for dtype in (np.int16, np.int32):
        bits = np.arange(-300, 300, dtype=dtype).reshape(2, 300)
        topk_probs(bits, 3, dtype == np.int16)
        gather_floats(bits, np.array([1]), np.array([[0, 5]]), dtype == np.int16)
