"""Compiled (numba) kernels: memory hash table, row updates, fusion, tree builders, suffix
automaton, the evidence builder and its calibration.

Everything numba compiles lives in this one file on purpose: numba's on-disk cache
(``cache=True``) is invalidated by the timestamp of the file that defines a function, not by the
files of the functions it calls. Kernels spread over several modules could silently keep a stale
copy of an edited callee; in one file they are always recompiled together.

Kernels compile lazily on first call; `vllm_recap.core.warmup` calls each once with non-empty
inputs. Entry points take arrays of fixed dtypes (the Python layer casts), so each compiles one
specialisation: tokens/parents/suffix/depths int64, rows float32, priors/discounts/scores
float64, blocked bool.

Arguments travel in bundles, so no kernel takes more than a handful: `Memories` (what a
request reads and writes), `DraftParams` (the builders' knobs), and inside the builders
`Nodes` (the tree being built) and `Scratch` (fusion buffers). Two numba costs shape
them. Python passes *plain* tuples in field order and entry points rebuild the NamedTuple:
numba types a plain tuple argument in C (~0.1 us) but a NamedTuple in Python (~0.8 us a call,
on a 16-node step of ~10 us). And bundles stop where per-node work starts: numba's reference-
count pruning removes the increments of plain array arguments but not of arrays inside tuple
arguments, so a bundle passed on every node costs two atomic operations per array per call
(measured: +50% on the 63-node tree). The per-node helpers therefore take plain arrays, which
their callers unpack from the bundles once.

Row layout (shared with ``memory.py``): one float32 record of W = 2K + 1 values,
``[ids (K, exact as float32 since ids < 2**21) | probs (K, sum 1) | conf]`` where
conf = exp(-H(probs)) is computed once at write time. Keeping a row in one record matters more
than anything else here: the memories are MBs of randomly accessed rows, and a step costs
roughly one L2 miss per cache line touched (separate id/prob/conf arrays tripled that).

    U (per partition)  u_rows [V, W]; conf = 0 = no row yet (a written row's conf >= 1/K).
    C + G (request)    one open-addressing (linear probing) table with rows inline:
                       tkeys [T] int64 (EMPTY = -1), tvals [T, W]; ring [R] int64 = keys in
                       insertion order, for FIFO eviction at the cap; meta [2] = (rows used,
                       next ring slot to evict once full).
    Keys pack 21-bit token ids: G = t2<<42 | t1<<21 | t0 (>= 0); C = -((t1<<21 | t0) + 2)
    (<= -2), so both live in one table and never collide with EMPTY.

Status codes returned by the observe kernels: 0 ok, 1 bad parents, 2 node token out of
range, 3 top-K id out of range, 4 bad probabilities (negative, NaN/inf or zero row sum).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

EMPTY = -1
FUSE_PRIORS_ENTROPY = 0
FUSE_BACKOFF = 1
FUSE_UNIFORM = 2
FUSE_PRIORS_FIXED = 3

_MUL = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: multiply, keep the top bits


# --------------------------------------------------------------------------- bundles


class Memories(NamedTuple):
    """The memories one request reads (tree builders) and writes (observe kernels)."""

    u_rows: np.ndarray  # [V, W] float32 U records of the request's partition
    ctx_on: bool  # C/G in use; if False the four arrays below are placeholders, never read
    tkeys: np.ndarray  # [T] int64 C/G keys, EMPTY = -1; T a power of two
    tvals: np.ndarray  # [T, W] float32 C/G records, inline in the table
    ring: np.ndarray  # [R] int64 keys in insertion order (FIFO eviction at the cap R)
    meta: np.ndarray  # [2] int64 (rows used, next ring slot to evict once full)


class DraftParams(NamedTuple):
    """The tree builders' knobs for one request-step."""

    max_depth: int  # deepest draft level, < len(discounts)
    discounts: np.ndarray  # [MAX_DEPTH + 1] float64 d(depth) by depth (config.discount_table)
    priors: np.ndarray  # [3] float64 specificity priors a_j
    mode: int  # FUSE_* row mixing rule
    no_repeat: bool  # forbid an edge (parent token, child token) twice on a root->node path
    blocked: np.ndarray  # [V] bool, tokens never drafted
    suffix_prior: float  # score floor of suffix nodes


class Nodes(NamedTuple):
    """A tree being built (capacity: budget + 1 + suffix, or template + suffix), root at 0.

    ct2/ct1 are the two tokens before each node in its path context, so a node's lookup key
    is (ct2[v], ct1[v], tok[v]) without walking the path; the root's are history[-3], [-2].
    """

    tok: np.ndarray  # [cap] int64
    par: np.ndarray  # [cap] int64, -1 at the root
    score: np.ndarray  # [cap] float64, 1.0 at the root
    depth: np.ndarray  # [cap] int64, 0 at the root
    ct2: np.ndarray  # [cap] int64, -1 = absent
    ct1: np.ndarray  # [cap] int64, -1 = absent


class Scratch(NamedTuple):
    """Buffers of one fusion (`_fuse`), reused for every node of a tree."""

    g: np.ndarray  # [3, W] float32 the rows found (G, C, U order)
    ids: np.ndarray  # [k] int64 fused candidates, by q descending
    q: np.ndarray  # [k] float64 their q, renormalised over them
    w: np.ndarray  # [3] float64 row weights
    buf_ids: np.ndarray  # [3 * width] int64 mixture support
    buf_m: np.ndarray  # [3 * width] float64 mixture mass


@njit(cache=True)
def _new_scratch(width, k):
    return Scratch(np.empty((3, 2 * width + 1), np.float32), np.empty(k, np.int64),
                   np.empty(k, np.float64), np.empty(3, np.float64),
                   np.empty(3 * width, np.int64), np.empty(3 * width, np.float64))


# --------------------------------------------------------------------------- hash table


@njit(cache=True, inline="always")
def _pack3(t2, t1, t0):
    return (t2 << 42) | (t1 << 21) | t0


@njit(cache=True, inline="always")
def _pack2(t1, t0):
    return -((t1 << 21) | t0) - 2


@njit(cache=True)
def table_bits(size):
    bits = 0
    while (1 << bits) < size:
        bits += 1
    return bits


@njit(cache=True, inline="always")
def _home(key, bits):
    return np.int64((np.uint64(key) * _MUL) >> np.uint64(64 - bits))


@njit(cache=True)
def _copy_row(dst, i, src, j):
    # Explicit loop: numba's slice assignment compiles slowly and runs slower for 17 floats.
    for c in range(src.shape[1]):
        dst[i, c] = src[j, c]


@njit(cache=True)
def _find(tkeys, key, bits):
    """Table index holding `key`, or -(index of the first empty slot on its probe path) - 1."""
    mask = (1 << bits) - 1
    i = _home(key, bits)
    while True:
        k = tkeys[i]
        if k == key:
            return i
        if k == EMPTY:
            return -i - 1
        i = (i + 1) & mask


@njit(cache=True)
def _delete(tkeys, tvals, key, bits):
    """Removes `key` by backward-shift deletion (no tombstones, so probes stay short)."""
    i = _find(tkeys, key, bits)
    if i < 0:
        return
    mask = (1 << bits) - 1
    j = i
    while True:
        j = (j + 1) & mask
        kj = tkeys[j]
        if kj == EMPTY:
            break
        h = _home(kj, bits)
        # Entry j may stay only if its home lies cyclically in (i, j].
        if i <= j:
            stays = i < h <= j
        else:
            stays = i < h or h <= j
        if stays:
            continue
        tkeys[i] = kj
        _copy_row(tvals, i, tvals, j)
        i = j
    tkeys[i] = EMPTY


@njit(cache=True)
def rehash(old_keys, old_vals, new_keys, new_vals):
    """Moves every entry of an old table into an empty (larger) one."""
    bits = table_bits(new_keys.shape[0])
    new_keys[:] = EMPTY
    for i in range(old_keys.shape[0]):
        key = old_keys[i]
        if key != EMPTY:
            j = -_find(new_keys, key, bits) - 1
            new_keys[j] = key
            _copy_row(new_vals, j, old_vals, i)


@njit(cache=True)
def context_slot(tkeys, key):
    """Table index holding `key`, or -1 (tests and introspection)."""
    i = _find(tkeys, key, table_bits(tkeys.shape[0]))
    return i if i >= 0 else -1


# --------------------------------------------------------------------------- row updates


@njit(cache=True)
def _ctx_put(key, rec, tkeys, tvals, ring, meta, bits):
    slot = _find(tkeys, key, bits)
    if slot < 0:
        n_rows = ring.shape[0]
        if meta[0] < n_rows:
            ring[meta[0]] = key
            meta[0] += 1
        else:
            # Full at the cap: evict the oldest-inserted key (FIFO ring; an overwrite does not
            # refresh a key's age).
            head = meta[1]
            _delete(tkeys, tvals, ring[head], bits)
            ring[head] = key
            meta[1] = (head + 1) % n_rows
            slot = _find(tkeys, key, bits)
        slot = -slot - 1
        tkeys[slot] = key
    for c in range(rec.shape[0]):  # a newer row overwrites the older one in place
        tvals[slot, c] = rec[c]


@njit(cache=True)
def _check_rows(ids, probs, vocab):
    for i in range(ids.shape[0]):
        total = 0.0
        for c in range(ids.shape[1]):
            if ids[i, c] < 0 or ids[i, c] >= vocab:
                return 3
            p = probs[i, c]
            if not (p >= 0.0 and p < np.inf):
                return 4
            total += p
        if not total > 0.0:
            return 4
    return 0


@njit(cache=True)
def _write_rows(ct2, ct1, ct0, ids, probs, mem):
    """Stores row i under U[ct0[i]], C[ct1[i], ct0[i]], G[ct2[i], ct1[i], ct0[i]] (-1 = absent)."""
    u_rows, ctx_on, tkeys, tvals, ring, meta = mem
    bits = table_bits(tkeys.shape[0])
    k = ids.shape[1]
    rec = np.empty(2 * k + 1, np.float32)
    for i in range(ids.shape[0]):
        total = 0.0
        for c in range(k):
            total += probs[i, c]
        ent = 0.0
        for c in range(k):
            p = probs[i, c] / total
            rec[c] = ids[i, c]
            rec[k + c] = p
            if p > 0.0:
                ent -= p * np.log(p)
        rec[2 * k] = np.exp(-ent)  # confidence c_j = exp(-H(P_j)), once per row
        t0 = ct0[i]
        for c in range(rec.shape[0]):
            u_rows[t0, c] = rec[c]
        if ctx_on and ct1[i] >= 0:
            _ctx_put(_pack2(ct1[i], ct0[i]), rec, tkeys, tvals, ring, meta, bits)
            if ct2[i] >= 0:
                _ctx_put(_pack3(ct2[i], ct1[i], ct0[i]), rec, tkeys, tvals, ring, meta, bits)


@njit(cache=True)
def observe_tree(tokens, parents, h2, h1, ids, probs, memories):
    """One verified step: node i's context = history (.., h2, h1) + path root->i.

    Validates everything before writing anything. tokens/parents [n] int64, ids [n, K] int64,
    probs [n, K] float32, memories = a `Memories` as a plain tuple. Returns a status code.
    """
    mem = Memories(*memories)
    n = tokens.shape[0]
    vocab = mem.u_rows.shape[0]
    if n == 0 or parents.shape[0] != n or parents[0] != -1:
        return 1
    for i in range(n):
        if tokens[i] < 0 or tokens[i] >= vocab:
            return 2
        if i > 0 and (parents[i] < 0 or parents[i] >= i):
            return 1
    status = _check_rows(ids, probs, vocab)
    if status != 0:
        return status
    ct2 = np.empty(n, np.int64)
    ct1 = np.empty(n, np.int64)
    ct2[0] = h2
    ct1[0] = h1
    for i in range(1, n):
        p = parents[i]
        ct2[i] = ct1[p]
        ct1[i] = tokens[p]
    _write_rows(ct2, ct1, tokens, ids, probs, mem)
    return 0


@njit(cache=True)
def observe_contexts(ctx3, ids, probs, memories):
    """Rows with explicit contexts ctx3 [n, 3] = (t-2, t-1, t), -1 = absent (prompt seeding)."""
    mem = Memories(*memories)
    vocab = mem.u_rows.shape[0]
    for i in range(ctx3.shape[0]):
        if ctx3[i, 2] < 0 or ctx3[i, 2] >= vocab:
            return 2
    status = _check_rows(ids, probs, vocab)
    if status != 0:
        return status
    _write_rows(ctx3[:, 0].copy(), ctx3[:, 1].copy(), ctx3[:, 2].copy(), ids, probs, mem)
    return 0


# --------------------------------------------------------------------------- lookup + fusion


@njit(cache=True)
def _gather(key, u_rows, ctx_on, tkeys, tvals, bits, g):
    """Copies the rows available for context key = (t2, t1, t0) into g [3, W]: G, C, U order.

    Returns their count r."""
    t2, t1, t0 = key
    r = 0
    if ctx_on and t1 >= 0:
        if t2 >= 0:
            slot = _find(tkeys, _pack3(t2, t1, t0), bits)
            if slot >= 0:
                _copy_row(g, r, tvals, slot)
                r += 1
        slot = _find(tkeys, _pack2(t1, t0), bits)
        if slot >= 0:
            _copy_row(g, r, tvals, slot)
            r += 1
    if u_rows[t0, u_rows.shape[1] - 1] > 0.0:
        _copy_row(g, r, u_rows, t0)
        r += 1
    return r


@njit(cache=True)
def _fuse(g, r, mode, priors, w, out_ids, out_q, buf_ids, buf_m):
    """Eqs. 4-6 over rows 0..r-1 of g [3, W] (most specific first); returns the count m.

    w [3]: the row weights (eq. 5), 0 beyond r. out_ids/out_q [k]: the top m = min(k,
    support) ids of the mixture by mass, q renormalised over them, by q descending (ties:
    first seen, i.e. the more specific row and its earlier entry). buf_ids/buf_m [3 * width]:
    scratch for the mixture's support and masses.
    """
    width = (g.shape[1] - 1) // 2
    for j in range(w.shape[0]):
        w[j] = 0.0
    if r == 0:
        return 0
    if mode == FUSE_BACKOFF:
        w[0] = 1.0
    elif mode == FUSE_UNIFORM:
        for j in range(r):
            w[j] = 1.0 / r
    else:
        total = 0.0
        for j in range(r):
            a = priors[j]  # prior by rank among the *available* rows
            if mode == FUSE_PRIORS_ENTROPY:
                a *= g[j, 2 * width]
            w[j] = a
            total += a
        for j in range(r):
            w[j] /= total
    nb = 0
    for j in range(r):
        wj = w[j]
        if wj <= 0.0:
            continue
        for c in range(width):
            z = np.int64(g[j, c])
            p = g[j, width + c]
            if p <= 0.0:
                continue
            found = -1
            for b in range(nb):
                if buf_ids[b] == z:
                    found = b
                    break
            if found >= 0:
                buf_m[found] += wj * p
            else:
                buf_ids[nb] = z
                buf_m[nb] = wj * p
                nb += 1
    n_out = min(out_ids.shape[0], nb)
    kept = 0.0
    for t in range(n_out):
        best = 0
        for b in range(1, nb):
            if buf_m[b] > buf_m[best]:
                best = b
        out_ids[t] = buf_ids[best]
        out_q[t] = buf_m[best]
        kept += buf_m[best]
        buf_m[best] = -1.0  # taken: every mass is > 0, so it is never the maximum again
    for t in range(n_out):
        out_q[t] /= kept
    return n_out


@njit(cache=True)
def fuse_rows(rows, mode, priors, k):
    """Entry point for `fusion.fuse`: records [r, W] -> (ids [k], q [k], weights [3], count)."""
    r = rows.shape[0]
    g, ids, q, w, buf_ids, buf_m = _new_scratch((rows.shape[1] - 1) // 2, k)
    for j in range(r):
        _copy_row(g, j, rows, j)
    ids.fill(-1)
    q.fill(0.0)
    n = _fuse(g, r, mode, priors, w, ids, q, buf_ids, buf_m)
    return ids, q, w, n


# --------------------------------------------------------------------------- tree builders
#
# Both builders: `_start_tree` sets up the nodes and scratch; every expanded node gets its
# candidates from `_gather` + `_fuse`; the suffix continuation merges on top
# (`_merge_suffix`); `_chain_first` writes the result into caller-owned buffers, out_ints
# [3, cap] int64 (rows: tokens, parents, depths) and out_scores [cap] float64: boxing fresh
# arrays back to Python costs more than the 16-node tree itself.


# Inlined (numba IR): returning thirteen arrays through a call cost ~0.5 us per tree.
@njit(cache=True, inline="always")
def _start_tree(hist, cap, width):
    """Nodes of capacity `cap` holding the root, and the fusion scratch (k = width).

    hist = (root, history[-3], history[-2]), -1 where the history is shorter.
    """
    nodes = Nodes(np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap, np.float64),
                  np.empty(cap, np.int64), np.empty(cap, np.int64), np.empty(cap, np.int64))
    nodes.tok[0] = hist[0]
    nodes.par[0] = -1
    nodes.score[0] = 1.0
    nodes.depth[0] = 0
    nodes.ct2[0] = hist[1]
    nodes.ct1[0] = hist[2]
    return nodes, _new_scratch(width, width)


@njit(cache=True)
def _edge_on_path(tok, par, v, z):
    """True if edge (tok[v] -> z) already occurs on the root->v path."""
    a = tok[v]
    u = v
    while par[u] >= 0:
        if tok[u] == z and tok[par[u]] == a:
            return True
        u = par[u]
    return False


@njit(cache=True)
def _add_node(nodes, n, p, z, s):
    """Appends node n = token z under p with score s; returns n + 1."""
    nodes.tok[n] = z
    nodes.par[n] = p
    nodes.score[n] = s
    nodes.depth[n] = nodes.depth[p] + 1
    nodes.ct2[n] = nodes.ct1[p]
    nodes.ct1[n] = nodes.tok[p]
    return n + 1


@njit(cache=True)
def _better(s1, q1, s2, q2):
    return s1 > s2 or (s1 == s2 and q1 < q2)


@njit(cache=True)
def _heap_push(hs, hq, size, s, q):
    i = size
    hs[i] = s
    hq[i] = q
    while i > 0:
        p = (i - 1) >> 1
        if not _better(hs[i], hq[i], hs[p], hq[p]):
            break
        hs[i], hs[p] = hs[p], hs[i]
        hq[i], hq[p] = hq[p], hq[i]
        i = p
    return size + 1


@njit(cache=True)
def _heap_pop(hs, hq, size):
    """Removes the best entry; returns (its sequence number, new size)."""
    top = hq[0]
    size -= 1
    if size > 0:
        hs[0] = hs[size]
        hq[0] = hq[size]
        i = 0
        while True:
            left = 2 * i + 1
            if left >= size:
                break
            best = left
            if left + 1 < size and _better(hs[left + 1], hq[left + 1], hs[left], hq[left]):
                best = left + 1
            if not _better(hs[best], hq[best], hs[i], hq[i]):
                break
            hs[i], hs[best] = hs[best], hs[i]
            hq[i], hq[best] = hq[best], hq[i]
            i = best
    return top, size


@njit(cache=True)
def _merge_suffix(n, nodes, suffix, params, mem, sc):
    """Walks the suffix continuation from the root, sharing existing nodes, adding the rest.

    Suffix node score = score(parent) * d(depth) * max(q(z | parent context), suffix_prior),
    q = 0 when z is not a fused candidate; a shared node keeps the larger score. Stops at
    max_depth, a blocked token or a repeated edge. A suffix-only child can make its parent
    K + 1 wide; it is "on top of the budget" in width as in count. Returns the node count.
    """
    tok, par, score, depth, ct2, ct1 = nodes
    g, ids, q_top, w, buf_ids, buf_m = sc
    u_rows, ctx_on, tkeys, tvals = mem.u_rows, mem.ctx_on, mem.tkeys, mem.tvals
    mode, priors = params.mode, params.priors
    bits = table_bits(tkeys.shape[0])
    cur = np.int64(0)  # typed, not Literal[int]: one specialisation of each callee
    for i in range(suffix.shape[0]):
        z = suffix[i]
        d = depth[cur] + 1
        if d > params.max_depth or params.blocked[z]:
            break
        r = _gather((ct2[cur], ct1[cur], tok[cur]), u_rows, ctx_on, tkeys, tvals, bits, g)
        nc = _fuse(g, r, mode, priors, w, ids, q_top, buf_ids, buf_m)
        q = 0.0
        for j in range(nc):
            if ids[j] == z:
                q = q_top[j]
                break
        s = score[cur] * params.discounts[d] * max(q, params.suffix_prior)
        child = -1
        for u in range(1, n):
            if par[u] == cur and tok[u] == z:
                child = u
                break
        if child >= 0:
            if s > score[child]:
                score[child] = s
            cur = child
        else:
            if params.no_repeat and _edge_on_path(tok, par, cur, z):
                break
            n = _add_node(nodes, n, cur, z, s)
            cur = n - 1
    return n


@njit(cache=True)
def _best_children(par, score, n):
    """[n] int64: each node's highest-scoring child (ties: the lower index), -1 for a leaf."""
    best = np.full(n, -1, np.int64)
    for u in range(1, n):
        p = par[u]
        if best[p] < 0 or score[u] > score[best[p]]:
            best[p] = u
    return best


@njit(cache=True)
def best_chain_length(parents, scores):
    """Length L of the best chain if it is laid out at 1..L (else the laid-out part of it).

    The best chain follows, from the root, the highest-scoring child (ties: lower index).
    parents [n] int64 (parents-first), scores [n] float64.
    """
    best = _best_children(parents, scores, parents.shape[0])
    length = 0
    while best[length] == length + 1:
        length += 1
    return length


@njit(cache=True, inline="always")
def _laid_after(a, b, capped, depths):
    """Whether node a goes after node b best first: lower capped score, then deeper, then
    the later index."""
    if capped[a] != capped[b]:
        return capped[a] < capped[b]
    if depths[a] != depths[b]:
        return depths[a] > depths[b]
    return a > b


@njit(cache=True)
def relay_best_first(tokens, parents, scores, depths, sources, has_sources, out_ints,
                     out_scores):
    """Lays a tree out best node first (`DraftTree.best_first`, one call instead of a dozen
    numpy calls on a few numbers, each 10-20 us right after the forward pass).

    Order: by score capped by the ancestors' (so parents come first), ties to the shallower
    then the earlier node (insertion sort: n is at most a few dozen).

    Args:
        tokens, parents, scores, depths: [n] the tree (int64, int64, float64, int64).
        sources: [n] int64 source bits (any [n] int64 array when ``has_sources`` is False).
        out_ints: [4, n] int64 out: tokens, parents re-indexed, depths, sources.
        out_scores: [n] float64 out.

    Returns the new layout's best chain length (`best_chain_length`).
    """
    n = parents.shape[0]
    capped = np.empty(n)
    capped[0] = scores[0]
    for i in range(1, n):
        c = capped[parents[i]]
        capped[i] = c if c < scores[i] else scores[i]
    order = np.empty(n, np.int64)
    for i in range(n):
        v = i
        j = i - 1
        while j >= 0 and _laid_after(order[j], v, capped, depths):
            order[j + 1] = order[j]
            j -= 1
        order[j + 1] = v
    _write_order(order, n, (tokens, parents, scores, depths, sources, sources), out_ints,
                 out_scores)
    for i in range(n):
        out_ints[3, i] = sources[order[i]] if has_sources else 0
    return best_chain_length(out_ints[1], out_scores)


@njit(cache=True)
def _chain_order(par, score, n):
    """The root, then the best chain at 1..L. Returns (order [n], filled up to L;
    placed [n] bool, the nodes already in it; L)."""
    best = _best_children(par, score, n)
    order = np.empty(n, np.int64)
    placed = np.zeros(n, np.bool_)
    order[0] = 0
    placed[0] = True
    m = 1
    v = 0
    while best[v] >= 0:
        v = best[v]
        order[m] = v
        placed[v] = True
        m += 1
    return order, placed, m - 1


@njit(cache=True)
def _write_order(order, n, nodes, out_ints, out_scores):
    """Writes nodes in `order` (parents first): out_ints[:3, :n] (tokens, parents re-indexed,
    depths) and out_scores[:n]."""
    tok, par, score, depth, _, _ = nodes
    new_index = np.empty(n, np.int64)
    for i in range(n):
        new_index[order[i]] = i
    for i in range(n):
        u = order[i]
        out_ints[0, i] = tok[u]
        out_ints[1, i] = new_index[par[u]] if par[u] >= 0 else -1
        out_ints[2, i] = depth[u]
        out_scores[i] = score[u]


@njit(cache=True)
def _chain_first(n, nodes, out_ints, out_scores):
    """Re-lays the tree so the best chain sits at 1..L; the rest keep their order, so
    parents-first still holds. Writes out_ints[:, :n] and out_scores[:n]; returns (n, L)."""
    order, placed, chain_len = _chain_order(nodes[1], nodes[2], n)
    m = chain_len + 1
    for u in range(1, n):
        if not placed[u]:
            order[m] = u
            m += 1
    _write_order(order, n, nodes, out_ints, out_scores)
    return n, chain_len


@njit(cache=True)
def build_best_first(hist, budget, draft_params, memories, suffix, out_ints, out_scores):
    """RECAP best-first tree + suffix merge.

    Args (tuples plain, in the field order of the bundles above):
        hist: (root, history[-3], history[-2]) int64, -1 where absent.
        budget: draft nodes before the suffix merge.
        draft_params: a `DraftParams`.
        memories: the request's `Memories`.
        suffix: [s] int64 continuation from the suffix automaton.
        out_ints, out_scores: [3, cap] and [cap] buffers (see above), cap >= budget + 1 + s.

    Returns (node count, best chain length).
    """
    params = DraftParams(*draft_params)
    mem = Memories(*memories)
    u_rows, ctx_on, tkeys, tvals = mem.u_rows, mem.ctx_on, mem.tkeys, mem.tvals
    # Locals, not params.x, for arrays used per node: an array taken from a tuple and passed
    # to a call pays a reference-count round trip at every call.
    max_depth, mode, priors = params.max_depth, params.mode, params.priors
    discounts, blocked = params.discounts, params.blocked
    k = (u_rows.shape[1] - 1) // 2
    bits = table_bits(tkeys.shape[0])
    nodes, sc = _start_tree(hist, budget + 1 + suffix.shape[0], k)
    tok, par, score, depth, ct2, ct1 = nodes
    g, ids, q_top, w, buf_ids, buf_m = sc
    # Candidates: at most k per expanded node, and at most `budget` nodes get expanded.
    h_cap = budget * k + 1
    hs = np.empty(h_cap, np.float64)
    hq = np.empty(h_cap, np.int64)
    c_par = np.empty(h_cap, np.int64)
    c_tok = np.empty(h_cap, np.int64)
    c_score = np.empty(h_cap, np.float64)
    # np.int64, not literals: literal ints would compile extra callee specialisations.
    size = np.int64(0)
    seq = np.int64(0)
    n = np.int64(1)
    v = np.int64(0)
    expand = budget > 0
    while expand:
        if depth[v] < max_depth:
            r = _gather((ct2[v], ct1[v], tok[v]), u_rows, ctx_on, tkeys, tvals, bits, g)
            nc = _fuse(g, r, mode, priors, w, ids, q_top, buf_ids, buf_m)
            disc = discounts[depth[v] + 1]
            for j in range(nc):
                z = ids[j]
                q = q_top[j]
                if q <= 0.0 or blocked[z]:
                    continue
                if params.no_repeat and _edge_on_path(tok, par, v, z):
                    continue
                s = score[v] * disc * q
                c_par[seq] = v
                c_tok[seq] = z
                c_score[seq] = s
                size = _heap_push(hs, hq, size, s, seq)
                seq += 1
        if n > budget or size == 0:
            break
        best, size = _heap_pop(hs, hq, size)
        n = _add_node(nodes, n, c_par[best], c_tok[best], c_score[best])
        v = n - 1
        expand = n <= budget  # the last node added needs no children
    if budget > 0 and suffix.shape[0] > 0:
        n = _merge_suffix(n, nodes, suffix, params, mem, sc)
    return _chain_first(n, nodes, out_ints, out_scores)


@njit(cache=True)
def build_template(hist, template, n_template, draft_params, memories, suffix, out_ints,
                   out_scores):
    """Static template filled from fused candidates (Token Recycling / FIXED tree ablation).

    template = (t_par, t_rank): entry t >= 1 = child of rank t_rank[t] (by q) of entry
    t_par[t] < t; entry 0 is the root; only entries < n_template are used. A missing rank, a
    blocked token, a repeated edge (if no_repeat) or max_depth prunes the entry and its
    subtree. Then the suffix merges. Other arguments as `build_best_first`; the outputs need
    capacity >= n_template + s. Returns (node count, chain length).
    """
    params = DraftParams(*draft_params)
    mem = Memories(*memories)
    u_rows, ctx_on, tkeys, tvals = mem.u_rows, mem.ctx_on, mem.tkeys, mem.tvals
    # Locals, not params.x, for arrays used per node: an array taken from a tuple and passed
    # to a call pays a reference-count round trip at every call.
    max_depth, mode, priors = params.max_depth, params.mode, params.priors
    discounts, blocked = params.discounts, params.blocked
    t_par, t_rank = template
    k = (u_rows.shape[1] - 1) // 2
    bits = table_bits(tkeys.shape[0])
    cap = n_template + suffix.shape[0]
    nodes, sc = _start_tree(hist, cap, k)
    tok, par, score, depth, ct2, ct1 = nodes
    g, _, _, w, buf_ids, buf_m = sc
    # Candidates per tree node, computed on first use (a node's children are not contiguous).
    cand_ids = np.empty((cap, k), np.int64)
    cand_q = np.empty((cap, k), np.float64)
    cand_n = np.full(cap, -1, np.int64)
    node_of = np.full(n_template, -1, np.int64)
    node_of[0] = 0
    n = np.int64(1)
    for t in range(1, n_template):
        v = node_of[t_par[t]]
        if v < 0 or depth[v] >= max_depth:
            continue
        if cand_n[v] < 0:
            r = _gather((ct2[v], ct1[v], tok[v]), u_rows, ctx_on, tkeys, tvals, bits, g)
            cand_n[v] = _fuse(g, r, mode, priors, w, cand_ids[v], cand_q[v], buf_ids, buf_m)
        rank = t_rank[t]
        if rank >= cand_n[v]:
            continue
        z = cand_ids[v, rank]
        q = cand_q[v, rank]
        if q <= 0.0 or blocked[z]:
            continue
        if params.no_repeat and _edge_on_path(tok, par, v, z):
            continue
        n = _add_node(nodes, n, v, z, score[v] * discounts[depth[v] + 1] * q)
        node_of[t] = n - 1
    if n_template > 1 and suffix.shape[0] > 0:
        n = _merge_suffix(n, nodes, suffix, params, mem, sc)
    return _chain_first(n, nodes, out_ints, out_scores)


# --------------------------------------------------------------------------- suffix automaton
#
# Arrays (owned by suffix.SuffixAutomaton): toks [cap] history; states [6, S] int32 rows
# (s_len, s_link, s_first = earliest end position, s_head = first outgoing edge, s_cnt =
# occurrence count = |endpos|, s_last = latest end position); edges [3, E] int32 rows (e_tok,
# e_to, e_next: a state's edges form a linked list, needed to copy them into a clone and to
# enumerate continuations); transitions hashed by key state << 21 | token -> edge in
# hkeys/hvals. meta = (tokens, states, edges, last state). Capacity (checked by the caller):
# states <= 2 n, edges <= 3 n, hash load <= 0.5.
#
# s_cnt and s_last change for every state on the new state's suffix-link chain (each gains
# the new end position), a walk as long as the chain. The walk stops after SAM_WALK states,
# so a long repetition (where the chain grows with the repeated length) costs O(SAM_WALK) per
# token; the states past the cap (the shorter contexts) then undercount and keep an older
# s_last. Continuations read them as evidence, never as exact counts.

SAM_WALK = 16


@njit(cache=True, inline="always")
def _sam_key(p, t):
    return (np.int64(p) << 21) | t


@njit(cache=True)
def _hash_put(hkeys, hvals, key, value, bits):
    """Inserts `key` -> `value`; the key must be absent."""
    slot = -_find(hkeys, key, bits) - 1
    hkeys[slot] = key
    hvals[slot] = value


@njit(cache=True)
def _sam_add_edge(p, t, to, s_head, e_tok, e_to, e_next, meta):
    """Prepends edge p --t--> to to p's edge list; returns its index (the caller hashes it)."""
    e = meta[2]
    meta[2] += 1
    e_tok[e] = t
    e_to[e] = to
    e_next[e] = s_head[p]
    s_head[p] = e
    return e


@njit(cache=True)
def sam_extend(new, toks, states, edges, hkeys, hvals, meta):
    """Appends tokens new [m] int64 (amortised O(1) each; Blumer et al.)."""
    s_len, s_link, s_first, s_head = states[0], states[1], states[2], states[3]
    s_cnt, s_last = states[4], states[5]
    e_tok, e_to, e_next = edges[0], edges[1], edges[2]
    bits = table_bits(hkeys.shape[0])
    for i in range(new.shape[0]):
        t = new[i]
        pos = meta[0]
        toks[pos] = t
        meta[0] += 1
        last = meta[3]
        cur = meta[1]
        meta[1] += 1
        s_len[cur] = s_len[last] + 1
        s_link[cur] = 0
        s_first[cur] = pos
        s_head[cur] = -1
        p = last
        e = -1
        while p != -1:
            slot = _find(hkeys, _sam_key(p, t), bits)
            if slot >= 0:
                e = hvals[slot]
                break
            added = _sam_add_edge(p, t, cur, s_head, e_tok, e_to, e_next, meta)
            _hash_put(hkeys, hvals, _sam_key(p, t), added, bits)
            p = s_link[p]
        if p != -1:
            q = e_to[e]
            if s_len[p] + 1 == s_len[q]:
                s_link[cur] = q
            else:
                clone = meta[1]
                meta[1] += 1
                s_len[clone] = s_len[p] + 1
                s_link[clone] = s_link[q]
                s_first[clone] = s_first[q]  # clone's end positions = q's plus later ones
                s_cnt[clone] = s_cnt[q]  # the walk below adds the new position
                s_last[clone] = s_last[q]
                s_head[clone] = -1
                f = s_head[q]
                while f >= 0:
                    added = _sam_add_edge(clone, e_tok[f], e_to[f], s_head, e_tok, e_to, e_next,
                                          meta)
                    _hash_put(hkeys, hvals, _sam_key(clone, e_tok[f]), added, bits)
                    f = e_next[f]
                while p != -1:
                    slot = _find(hkeys, _sam_key(p, t), bits)
                    if slot < 0 or e_to[hvals[slot]] != q:
                        break
                    e_to[hvals[slot]] = clone
                    p = s_link[p]
                s_link[q] = clone
                s_link[cur] = clone
        s_cnt[cur] = 1
        s_last[cur] = pos
        p = s_link[cur]
        steps = 0
        while p > 0 and steps < SAM_WALK:
            s_cnt[p] += 1
            s_last[p] = pos
            p = s_link[p]
            steps += 1
        meta[3] = cur


@njit(cache=True)
def sam_rehash(states, edges, n_states, hkeys, hvals):
    """Rebuilds the transition hash (after it grew) from the per-state edge lists."""
    s_head, e_tok, e_next = states[3], edges[0], edges[2]
    bits = table_bits(hkeys.shape[0])
    hkeys[:] = EMPTY
    for p in range(n_states):
        e = s_head[p]
        while e >= 0:
            _hash_put(hkeys, hvals, _sam_key(p, e_tok[e]), e, bits)
            e = e_next[e]


@njit(cache=True)
def sam_match(tokens, states, edges, hkeys, hvals, match):
    """Extends a match against an automaton's text by `tokens` [m] int64.

    match [2] int64 = (state, length): the longest suffix of the tokens fed so far that occurs
    in the text (the matching statistics of Blumer et al.; amortised O(1) per token), updated
    in place. Start from (0, 0).
    """
    s_len, s_link = states[0], states[1]
    e_to = edges[1]
    bits = table_bits(hkeys.shape[0])
    v = match[0]
    length = match[1]
    for i in range(tokens.shape[0]):
        t = tokens[i]
        while True:
            slot = _find(hkeys, _sam_key(v, t), bits)
            if slot >= 0:
                v = e_to[hvals[slot]]
                length += 1
                break
            if v == 0:
                length = 0
                break
            v = s_link[v]
            length = s_len[v]
    match[0] = v
    match[1] = length


# --------------------------------------------------------------------------- evidence builder
#
# One best-first tree over every node source, scored by estimated P(node accepted): memory
# candidates (fused rows, as `build_best_first`) and continuations read from suffix automata
# (the request's own text, and the shared index of earlier requests' outputs). A node's score
# is its parent's times a conditional acceptance probability looked up in one calibration
# table (calibration.py) by the node's features:
#
#   memory   cell (rival, depth bucket, q bucket): q = the fused probability of the token;
#            rival = what the automata say about the same parent: no continuation, a weaker
#            (< 0.5) or stronger one for another token, or this very token (only one child
#            of a node can hold, so a memory candidate next to a confident continuation of
#            another token is worth much less than its q alone says)
#   suffix   cell (source, match-length bucket, agreement bucket): the context matched so far
#            (the history's repeated suffix plus the path from the root) and how many of the
#            text's occurrences of that context continue with this token (count / total)
#
# Memory nodes spend the node budget; suffix nodes have their own allowance (suffix_len) on
# top, and a suffix node is added only while its path probability is >= min_prob, so long
# continuations appear only where the evidence holds. A token proposed by two sources is one
# node with the larger score; memory candidates grow from suffix nodes too.

MEM_RIVALS = 4  # memory cells: no continuation, a weak / strong one of another token, same token
MEM_DEPTHS = 8  # memory cells: depth 1..7, 8+
MEM_QS = 10  # memory cells: q in tenths
MEM_ROWS = MEM_RIVALS * MEM_DEPTHS
SUF_ES = 11  # suffix cells: matched length 1, 2, 3, 4, 5-6, 7-8, 9-12, 13-16, 17-24, 25-32, 33+
SUF_FS = 7  # suffix cells: count/total <= 1/4, <= 1/2, <= 3/4, < 1, all of 1, all of 2, all of 3+
MEM_CELLS = MEM_ROWS * MEM_QS
SUF_CELLS = SUF_ES * SUF_FS
N_CELLS = MEM_CELLS + 2 * SUF_CELLS
SUF_WIDTH = 4  # continuations pushed per automaton state (the most probable)
SRC_MEMORY, SRC_SUFFIX, SRC_SHARED = 0, 1, 2  # rows of a node's feature record
_E_BUCKET = np.array([0, 0, 1, 2, 3, 4, 4, 5, 5] + [6] * 4 + [7] * 4 + [8] * 8 + [9] * 8,
                     np.int64)  # match length 0..32 -> row; longer -> SUF_ES - 1


RIVAL_NONE, RIVAL_WEAK, RIVAL_STRONG, RIVAL_SAME = 0, 1, 2, 3


@njit(cache=True, inline="always")
def _mem_row(rival, depth):
    return (rival * MEM_DEPTHS + min(depth, MEM_DEPTHS) - 1) * MEM_QS


@njit(cache=True, inline="always")
def _mem_cell(rival, depth, q):
    """Calibration cell of a memory node at `depth` whose fused probability is q."""
    return _mem_row(rival, depth) + min(np.int64(q * MEM_QS), MEM_QS - 1)


@njit(cache=True, inline="always")
def _suffix_cell(src, length, count, total):
    """Cell of a continuation from source src (0 request, 1 shared) after a matched context
    of `length` tokens that `count` of its `total` continuing occurrences agree with."""
    eb = _E_BUCKET[length] if length <= 32 else SUF_ES - 1
    if count >= total:
        fb = 4 if total == 1 else (5 if total == 2 else 6)
    elif 4 * count > 3 * total:
        fb = 3
    elif 2 * count > total:
        fb = 2
    elif 4 * count > total:
        fb = 1
    else:
        fb = 0
    return MEM_CELLS + src * SUF_CELLS + eb * SUF_FS + fb


@njit(cache=True, inline="always")
def _mem_prob(table, learned, discounts, rival, depth, q):
    """Conditional acceptance of a memory child at `depth` with fused probability q: the
    calibrated row interpolated in q, or (not learned) the paper's d(depth) * q."""
    if not learned:
        return discounts[depth] * q
    row = _mem_row(rival, depth)
    x = q * MEM_QS - 0.5
    i = np.int64(np.floor(x))
    if i < 0:
        return table[row]
    if i >= MEM_QS - 1:
        return table[row + MEM_QS - 1]
    f = x - i
    return table[row + i] * (1.0 - f) + table[row + i + 1] * f


@njit(cache=True)
def _sam_children(states, edges, state, length, src, base, table, blocked, min_p, c_tok,
                  c_state, c_p, c_cell):
    """The best continuations after automaton `state` (matched context of `length` tokens).

    Writes up to SUF_WIDTH of them into c_* [SUF_WIDTH] (token, next state, path probability
    base * P(cell), cell), by probability, then recency (latest end position); skips blocked
    tokens, separators (ids >= vocab) and paths below min_p. Returns the count.
    """
    s_head, s_cnt, s_last = states[3], states[4], states[5]
    e_tok, e_to, e_next = edges[0], edges[1], edges[2]
    total = 0
    e = s_head[state]
    while e >= 0:
        total += s_cnt[e_to[e]]
        e = e_next[e]
    m = 0
    if total <= 0:
        return m
    last = np.empty(SUF_WIDTH, np.int64)
    e = s_head[state]
    while e >= 0:
        t = e_tok[e]
        w = e_to[e]
        e = e_next[e]
        if t >= blocked.shape[0] or blocked[t]:
            continue
        cell = _suffix_cell(src, length, s_cnt[w], total)
        p = base * table[cell]
        if p < min_p:
            continue
        lw = s_last[w]
        # insertion into the kept list, best first
        j = m
        while j > 0 and (c_p[j - 1] < p or (c_p[j - 1] == p and last[j - 1] < lw)):
            j -= 1
        if j >= SUF_WIDTH:
            continue
        top = min(m, SUF_WIDTH - 1)
        for i in range(top, j, -1):
            c_tok[i], c_state[i], c_p[i] = c_tok[i - 1], c_state[i - 1], c_p[i - 1]
            c_cell[i], last[i] = c_cell[i - 1], last[i - 1]
        c_tok[j], c_state[j], c_p[j], c_cell[j], last[j] = t, w, p, cell, lw
        m = min(m + 1, SUF_WIDTH)
    return m


@njit(cache=True, inline="always")
def _push(hs, hq, size, seq, e_int, e_score, kind, parent, z, s, state, length, cell):
    """Pushes candidate `seq` (kind 0 memory, 1 request suffix, 2 shared) onto the heap."""
    e_int[0, seq] = kind
    e_int[1, seq] = parent
    e_int[2, seq] = z
    e_int[3, seq] = state
    e_int[4, seq] = length
    e_int[5, seq] = cell
    e_score[seq] = s
    return _heap_push(hs, hq, size, s, seq)


@njit(cache=True)
def build_evidence(hist, limits, draft_params, memories, sams, calib, out_ints, out_scores,
                   out_feats):
    """Best-first tree over memory, request-suffix and shared-index candidates (see above).

    Args (tuples plain):
        hist: (root, history[-3], history[-2]) int64, -1 where absent.
        limits: (memory node budget, suffix node allowance, deepest suffix level,
            min_prob) -- int, int, int, float.
        draft_params: a `DraftParams` (suffix_prior unused).
        memories: the request's `Memories`.
        sams: (states, edges, state, length) of the request's automaton, then of the shared
            index: the matched state and context length (state 0 = no match; length below
            the minimum match is passed as state 0).
        calib: (table [N_CELLS] float64 conditional acceptance per cell, learned): when not
            learned, memory nodes use d(depth) * q and suffix cells their prior.
        out_ints, out_scores: [4, cap], [cap] (tokens/parents/depths/source bits, scores),
            cap >= 1 + budget + allowance.
        out_feats: [3, cap] int64 per node: its memory, suffix and shared cell, -1 if that
            source did not propose it.

    Returns (node count, best chain length).
    """
    params = DraftParams(*draft_params)
    mem = Memories(*memories)
    u_rows, ctx_on, tkeys, tvals = mem.u_rows, mem.ctx_on, mem.tkeys, mem.tvals
    max_depth, mode, priors = params.max_depth, params.mode, params.priors
    discounts, blocked = params.discounts, params.blocked
    budget, allowance, suf_depth, min_p = limits
    st_l, ed_l, v_l, m_l, st_s, ed_s, v_s, m_s = sams
    table, learned = calib
    k = (u_rows.shape[1] - 1) // 2
    bits = table_bits(tkeys.shape[0])
    cap = 1 + budget + allowance
    nodes, sc = _start_tree(hist, cap, k)
    tok, par, score, depth, ct2, ct1 = nodes
    g, ids, q_top, w, buf_ids, buf_m = sc
    first = np.full(cap, -1, np.int64)  # child lists: first child, next sibling
    nxt = np.empty(cap, np.int64)
    feat = np.full((3, cap), -1, np.int64)
    cand_ids = np.empty((cap, k), np.int64)  # each node's fused candidates (memory features)
    cand_q = np.empty((cap, k), np.float64)
    cand_n = np.zeros(cap, np.int64)
    h_cap = cap * (k + 2 * SUF_WIDTH) + 1
    hs = np.empty(h_cap, np.float64)
    hq = np.empty(h_cap, np.int64)
    e_int = np.empty((6, h_cap), np.int64)
    e_score = np.empty(h_cap, np.float64)
    c_tok = np.empty(SUF_WIDTH, np.int64)
    c_state = np.empty(SUF_WIDTH, np.int64)
    c_p = np.empty(SUF_WIDTH, np.float64)
    c_cell = np.empty(SUF_WIDTH, np.int64)
    r_tok = np.empty(2 * SUF_WIDTH, np.int64)  # continuations of the node being grown
    size = np.int64(0)
    seq = np.int64(0)
    n = np.int64(1)
    mem_left = budget
    suf_left = allowance
    # Each round grows node x: its continuations from the automaton state it was reached
    # by (the root: both automata's matches), and, for a new node, its memory candidates.
    # Then the best candidate either becomes a node or joins an existing one.
    x = np.int64(0)
    kind = np.int64(0)
    state = np.int64(0)
    length = np.int64(0)
    new_node = True
    while True:
        n_rival = 0
        rival_p = 0.0  # the strongest continuation's conditional probability
        for src in range(2):
            if x == 0:
                s0, l0 = (v_l, m_l) if src == 0 else (v_s, m_s)
            elif kind == src + 1:
                s0, l0 = state, length
            else:
                continue
            if s0 <= 0 or suf_left <= 0 or depth[x] >= suf_depth:
                continue
            if src == 0:
                m = _sam_children(st_l, ed_l, s0, l0, 0, score[x], table, blocked, min_p,
                                  c_tok, c_state, c_p, c_cell)
            else:
                m = _sam_children(st_s, ed_s, s0, l0, 1, score[x], table, blocked, min_p,
                                  c_tok, c_state, c_p, c_cell)
            for j in range(m):
                size = _push(hs, hq, size, seq, e_int, e_score, src + 1, x, c_tok[j], c_p[j],
                             c_state[j], l0 + 1, c_cell[j])
                seq += 1
                r_tok[n_rival] = c_tok[j]
                n_rival += 1
                rival_p = max(rival_p, table[c_cell[j]])
        if new_node and depth[x] < max_depth and (mem_left > 0 or suf_left > 0):
            r = _gather((ct2[x], ct1[x], tok[x]), u_rows, ctx_on, tkeys, tvals, bits, g)
            nc = _fuse(g, r, mode, priors, w, cand_ids[x], cand_q[x], buf_ids, buf_m)
            cand_n[x] = nc
            if mem_left > 0:
                d = depth[x] + 1
                for j in range(nc):
                    z = cand_ids[x, j]
                    q = cand_q[x, j]
                    if q <= 0.0 or blocked[z]:
                        continue
                    if params.no_repeat and _edge_on_path(tok, par, x, z):
                        continue
                    rival = RIVAL_NONE
                    if n_rival > 0:
                        rival = RIVAL_STRONG if rival_p >= 0.5 else RIVAL_WEAK
                        for j2 in range(n_rival):
                            if r_tok[j2] == z:
                                rival = RIVAL_SAME
                    s = score[x] * _mem_prob(table, learned, discounts, rival, d, q)
                    size = _push(hs, hq, size, seq, e_int, e_score, 0, x, z, s, 0, 0,
                                 _mem_cell(rival, d, q))
                    seq += 1
        # The next node to grow: a new one, or an existing one a second source reached.
        x = -1
        while size > 0 and (mem_left > 0 or suf_left > 0):
            best, size = _heap_pop(hs, hq, size)
            kind = e_int[0, best]
            u = e_int[1, best]
            z = e_int[2, best]
            s = e_score[best]
            state = e_int[3, best]
            length = e_int[4, best]
            child = first[u]
            while child >= 0 and tok[child] != z:
                child = nxt[child]
            if child >= 0:
                # One node, the larger score, both sources' evidence; a suffix source also
                # continues from it.
                if s > score[child]:
                    score[child] = s
                if feat[kind, child] < 0:
                    feat[kind, child] = e_int[5, best]
                if kind > 0:
                    x = child
                    new_node = False
                    break
                continue
            if kind == 0:
                if mem_left == 0:
                    continue
                mem_left -= 1
            else:
                if suf_left == 0:
                    continue
                suf_left -= 1
            n = _add_node(nodes, n, u, z, s)
            x = n - 1
            nxt[x] = first[u]
            first[u] = x
            feat[kind, x] = e_int[5, best]
            if kind > 0:
                # A continuation the memories also predict carries their evidence too.
                for j in range(cand_n[u]):
                    if cand_ids[u, j] == z:
                        feat[0, x] = _mem_cell(RIVAL_SAME, depth[x], cand_q[u, j])
                        sm = score[u] * _mem_prob(table, learned, discounts, RIVAL_SAME,
                                                  depth[x], cand_q[u, j])
                        if sm > score[x]:
                            score[x] = sm
                        break
            new_node = True
            break
        if x < 0:
            break
    return _layout_by_score(n, nodes, feat, out_ints, out_scores, out_feats)


@njit(cache=True)
def _layout_by_score(n, nodes, feat, out_ints, out_scores, out_feats):
    """Lays the best chain at 1..L, then every other node by score (ties: build order).

    Every prefix of the layout is then the best tree of its size, which is what an engine
    that verifies the first b nodes wants. Scores never exceed their parent's, so the layout
    is parents-first; should rounding ever break that, the build order is used instead.
    Writes out_ints[:, :n], out_scores[:n], out_feats[:, :n]; returns (n, L).
    """
    par, score = nodes[1], nodes[2]
    order, placed, chain_len = _chain_order(par, score, n)
    m = chain_len + 1
    for u in np.argsort(-score[:n], kind="mergesort"):
        if not placed[u]:
            order[m] = u
            m += 1
    position = np.empty(n, np.int64)
    for i in range(n):
        position[order[i]] = i
    for i in range(1, n):
        if position[par[order[i]]] >= i:  # not parents-first: keep the build order
            m = chain_len + 1
            for u in range(1, n):
                if not placed[u]:
                    order[m] = u
                    m += 1
            break
    _write_order(order, n, nodes, out_ints, out_scores)
    for i in range(n):
        u = order[i]
        mask = 0
        for f in range(3):
            out_feats[f, i] = feat[f, u]
            if feat[f, u] >= 0:
                mask |= 1 << f
        out_ints[3, i] = mask
    return n, chain_len


@njit(cache=True)
def same_prefix(tokens, parents, p_tokens, p_parents):
    """True if the tree (tokens, parents) [n] is the first n nodes of (p_tokens, p_parents)."""
    n = tokens.shape[0]
    if n > p_tokens.shape[0]:
        return False
    for i in range(n):
        if tokens[i] != p_tokens[i] or parents[i] != p_parents[i]:
            return False
    return True


# --------------------------------------------------------------------------- calibration
#
# Learning scales the priors per *row* of cells (memory: rival x depth; suffix: source x
# matched length): factor = (holds + w) / (prior-expected holds + w) over the row's tested
# nodes, so every cell of a row moves together, from pooled evidence. The priors keep their
# shape (q, agreement), which a few hundred observations per cell could only add noise to.

N_ROWS = MEM_ROWS + 2 * SUF_ES
CELL_CAP = 512.0  # per-row observation window (prior-expected holds): past it, halved
P_MAX = 0.98  # no conditional acceptance is certain


@njit(cache=True, inline="always")
def _cell_row(c):
    """Row of cell c (memory rows first, then each source's matched-length rows)."""
    if c < MEM_CELLS:
        return c // MEM_QS
    return MEM_ROWS + (c - MEM_CELLS) // SUF_FS


@njit(cache=True)
def learn_step(tokens, parents, depths, feats, n, committed, stats, prior, weight, learn,
               table, counters):
    """Learns from one verified proposal which of its nodes held.

    A node is *tested* when its parent was accepted (the root always is); it holds if it was
    accepted too. Accepted nodes follow the committed tokens (all but the last, the target's
    own token) through the first n nodes of the proposal.

    Args:
        tokens, parents, depths: [>= n] the proposal (layout order).
        feats: [3, >= n] int64 node cells per source (memory, suffix, shared), -1 = none.
        n: nodes verified (root included).
        committed: [c] int64 tokens committed after verification.
        stats: [2, N_ROWS] float64 (holds, prior-expected holds) per row, halved past
            CELL_CAP expected holds.
        prior: [N_CELLS] float64 prior acceptance per cell; weight: pseudo-holds (and
            pseudo-expected holds) of each row's prior factor 1.
        learn: update stats and table (False: counters only, the table stays at the prior).
        table: [N_CELLS] float64 the builders' table: prior * row factor, at most P_MAX.
        counters: [3, 3, MAX_DEPTH + 1] float64 (tested, held, predicted) x source x depth.

    Returns the number of accepted draft nodes.
    """
    acc = np.zeros(n, np.bool_)
    acc[0] = True
    cur = 0
    n_acc = 0
    for j in range(committed.shape[0] - 1):
        found = -1
        for i in range(cur + 1, n):
            if parents[i] == cur and tokens[i] == committed[j]:
                found = i
                break
        if found < 0:
            break
        acc[found] = True
        cur = found
        n_acc += 1
    top = counters.shape[2] - 1
    touched = np.zeros(N_ROWS, np.bool_)
    for i in range(1, n):
        if not acc[parents[i]]:
            continue
        held = 1.0 if acc[i] else 0.0
        d = min(depths[i], top)
        for f in range(3):
            c = feats[f, i]
            if c < 0:
                continue
            counters[0, f, d] += 1.0
            counters[1, f, d] += held
            counters[2, f, d] += table[c]
            if learn:
                r = _cell_row(c)
                stats[0, r] += held
                stats[1, r] += prior[c]
                if stats[1, r] > CELL_CAP:
                    stats[0, r] *= 0.5
                    stats[1, r] *= 0.5
                touched[r] = True
    for r in range(N_ROWS):
        if touched[r]:
            _refresh_row(r, stats, prior, weight, table)
    return n_acc


@njit(cache=True)
def _refresh_row(r, stats, prior, weight, table):
    factor = (stats[0, r] + weight) / (stats[1, r] + weight)
    if r < MEM_ROWS:
        first, width = r * MEM_QS, MEM_QS
    else:
        first, width = MEM_CELLS + (r - MEM_ROWS) * SUF_FS, SUF_FS
    for c in range(first, first + width):
        table[c] = min(P_MAX, prior[c] * factor)


@njit(cache=True)
def refresh_table(stats, prior, weight, table):
    """Recomputes every cell of the builders' table from the row counts."""
    for r in range(N_ROWS):
        _refresh_row(r, stats, prior, weight, table)


# --------------------------------------------------------------------------- acceptance calibration
# (budget.AcceptanceCalibration's per-step arithmetic: right after the forward pass each numpy
# call on its [depths, bins] tables cost 10-20 us, ~20 of them a step, against one call here.)

@njit(cache=True, inline="always")
def _score_bin(edges, x):
    """np.searchsorted(edges, x, side="right") for sorted edges."""
    s = 0
    while s < edges.shape[0] and edges[s] <= x:
        s += 1
    return s


@njit(cache=True)
def calibration_observe(accepted, mass, decay, depths, scores, classes, hits, edges, max_depth):
    """Decays both [C, D + 1, bins] tables, adds each non-root node's score to ``mass`` and 1
    to ``accepted`` for each hit node (indices into the tree, root excluded), at the node's
    class ``classes[i]``, in place; the additions run in node order, as ``np.add.at`` does."""
    accepted *= decay
    mass *= decay
    num_classes = accepted.shape[0]  # a class out of range wraps (never out of bounds)
    for i in range(1, depths.shape[0]):
        c = classes[i] % num_classes
        mass[c, min(depths[i], max_depth), _score_bin(edges, scores[i])] += scores[i]
    for h in hits:
        c = classes[h] % num_classes
        accepted[c, min(depths[h], max_depth), _score_bin(edges, scores[h])] += 1.0


@njit(cache=True)
def calibration_factors(accepted, mass, prior_mass, prior, prior_depth_mass, out):
    """out[c, d, s] = (accepted + prior_mass[s] * f_cd) / (mass + prior_mass[s]): f_cd = the
    class's pooled factor at depth d (sums over its bins), shrunk to f_d = every class's
    pooled factor at depth d, itself shrunk to prior[d] (``prior_depth_mass`` each) -- both
    priors scaled by what the depth above learned: f_d's by f_{d-1} / prior[d-1], f_cd's by
    the class's own ratio to f_{d-1} (a source whose scores overrate its nodes at depth 3
    overrates them at depth 4 too, and deep nodes are too rare to learn that alone)."""
    num_classes, depths, bins = accepted.shape
    above = 1.0  # f_{d-1} / prior[d-1]
    class_above = np.ones(num_classes)  # f_{c,d-1} / f_{d-1}
    class_a = np.empty(num_classes)  # per class at depth d: accepted and mass over its bins
    class_m = np.empty(num_classes)
    for d in range(depths):
        a = 0.0
        m = 0.0
        for c in range(num_classes):
            ac = 0.0
            mc = 0.0
            for s in range(bins):
                ac += accepted[c, d, s]
                mc += mass[c, d, s]
            class_a[c] = ac
            class_m[c] = mc
            a += ac
            m += mc
        pooled = (a + prior_depth_mass * prior[d] * above) / (m + prior_depth_mass)
        for c in range(num_classes):
            own = ((class_a[c] + prior_depth_mass * pooled * class_above[c])
                   / (class_m[c] + prior_depth_mass))
            class_above[c] = own / pooled if pooled > 0.0 else 1.0
            for s in range(bins):
                out[c, d, s] = ((accepted[c, d, s] + prior_mass[s] * own)
                                / (mass[c, d, s] + prior_mass[s]))
        above = pooled / prior[d] if prior[d] > 0.0 else 1.0


@njit(cache=True)
def calibration_probabilities(factors, edges, depths, parents, scores, classes, max_depth, out):
    """out[:n] = P(node accepted): min(1, factor of the node's class, depth and score bin x
    score), root 1, never above the parent's."""
    out[0] = 1.0
    for i in range(1, depths.shape[0]):
        c = classes[i] % factors.shape[0]
        f = factors[c, min(depths[i], max_depth), _score_bin(edges, scores[i])]
        p = min(1.0, f * scores[i])
        q = out[parents[i]]
        out[i] = p if p < q else q
