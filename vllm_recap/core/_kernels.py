"""Compiled (numba) kernels: memory hash table, row updates, fusion, tree builders.

Everything numba compiles lives in this one file on purpose: numba's on-disk cache
(``cache=True``) is invalidated by the timestamp of the file that defines a function, not by the
files of the functions it calls. Kernels spread over several modules could silently keep a stale
copy of an edited callee; in one file they are always recompiled together.

Kernels compile lazily on first call; `vllm_recap.core.warmup` calls each once with non-empty
inputs. Entry points take arrays of fixed dtypes (the Python layer casts), so each compiles one
specialisation: tokens/parents/suffix int64, rows float32, priors/discounts float64, blocked bool.

Row layout (shared with ``memory.py``): one float32 record of W = 2K + 1 values,
``[ids (K, exact as float32 since ids < 2**21) | probs (K, sum 1) | conf]`` where
conf = exp(-H(probs)) is computed once at write time. Keeping a row in one record matters more
than anything else here: the memories are MBs of randomly accessed rows, and a step costs
roughly one L2 miss per cache line touched (separate id/prob/conf arrays tripled that).

    U (per partition)  u_rows [V, W]; conf < 0 = no row yet.
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

import numpy as np
from numba import njit

EMPTY = -1
FUSE_PRIORS_ENTROPY = 0
FUSE_BACKOFF = 1
FUSE_UNIFORM = 2
FUSE_PRIORS_FIXED = 3

_MUL = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: multiply, keep the top bits


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
def _write_rows(ct2, ct1, ct0, ids, probs, u_rows, ctx_on, tkeys, tvals, ring, meta):
    """Stores row i under U[ct0[i]], C[ct1[i], ct0[i]], G[ct2[i], ct1[i], ct0[i]] (-1 = absent)."""
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
def observe_tree(tokens, parents, h2, h1, ids, probs, u_rows, ctx_on, tkeys, tvals, ring, meta):
    """One verified step: node i's context = history + path root->i. Validates before writing."""
    n = tokens.shape[0]
    vocab = u_rows.shape[0]
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
    _write_rows(ct2, ct1, tokens, ids, probs, u_rows, ctx_on, tkeys, tvals, ring, meta)
    return 0


@njit(cache=True)
def observe_contexts(ctx3, ids, probs, u_rows, ctx_on, tkeys, tvals, ring, meta):
    """Rows with explicit contexts ctx3 [n, 3] = (t-2, t-1, t), -1 = absent (prompt seeding)."""
    vocab = u_rows.shape[0]
    for i in range(ctx3.shape[0]):
        if ctx3[i, 2] < 0 or ctx3[i, 2] >= vocab:
            return 2
    status = _check_rows(ids, probs, vocab)
    if status != 0:
        return status
    _write_rows(ctx3[:, 0].copy(), ctx3[:, 1].copy(), ctx3[:, 2].copy(), ids, probs, u_rows,
                ctx_on, tkeys, tvals, ring, meta)
    return 0


# --------------------------------------------------------------------------- lookup + fusion


@njit(cache=True)
def _gather(t2, t1, t0, u_rows, ctx_on, tkeys, tvals, bits, g):
    """Copies the rows available for context (.., t2, t1, t0) into g [3, W]: G, C, U order."""
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
    if u_rows[t0, u_rows.shape[1] - 1] >= 0.0:
        _copy_row(g, r, u_rows, t0)
        r += 1
    return r


@njit(cache=True)
def _fuse(g, r, mode, priors, k, out_ids, out_q, out_w, buf_ids, buf_m, taken):
    """Eqs. 4-6 over rows 0..r-1 of g [3, W] (most specific first); returns the candidate count.

    out_ids/out_q: the top-k of the mixture, q renormalised over them, by q descending (ties:
    first seen, i.e. the more specific row and its earlier entry). out_w: the row weights.
    """
    width = (g.shape[1] - 1) // 2
    for j in range(out_w.shape[0]):
        out_w[j] = 0.0
    if r == 0:
        return 0
    if mode == FUSE_BACKOFF:
        out_w[0] = 1.0
    elif mode == FUSE_UNIFORM:
        for j in range(r):
            out_w[j] = 1.0 / r
    else:
        total = 0.0
        for j in range(r):
            a = priors[j]  # prior by rank among the *available* rows
            if mode == FUSE_PRIORS_ENTROPY:
                a *= g[j, 2 * width]
            out_w[j] = a
            total += a
        for j in range(r):
            out_w[j] /= total
    nb = 0
    for j in range(r):
        w = out_w[j]
        if w <= 0.0:
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
                buf_m[found] += w * p
            else:
                buf_ids[nb] = z
                buf_m[nb] = w * p
                taken[nb] = False
                nb += 1
    n_out = min(k, nb)
    kept = 0.0
    for t in range(n_out):
        best = -1
        for b in range(nb):
            if not taken[b] and (best < 0 or buf_m[b] > buf_m[best]):
                best = b
        taken[best] = True
        out_ids[t] = buf_ids[best]
        out_q[t] = buf_m[best]
        kept += buf_m[best]
    for t in range(n_out):
        out_q[t] /= kept
    return n_out


@njit(cache=True)
def fuse_rows(rows, mode, priors, k):
    """Entry point for `fusion.fuse`: records [r, W] -> (ids [k], q [k], weights [3], count)."""
    r = rows.shape[0]
    width = (rows.shape[1] - 1) // 2
    g = np.zeros((3, rows.shape[1]), np.float32)
    for j in range(r):
        _copy_row(g, j, rows, j)
    out_ids = np.full(k, -1, np.int64)
    out_q = np.zeros(k, np.float64)
    out_w = np.zeros(3, np.float64)
    buf_ids = np.empty(3 * width, np.int64)
    buf_m = np.empty(3 * width, np.float64)
    taken = np.empty(3 * width, np.bool_)
    n = _fuse(g, r, mode, priors, k, out_ids, out_q, out_w, buf_ids, buf_m, taken)
    return out_ids, out_q, out_w, n


# --------------------------------------------------------------------------- tree builders
#
# Node arrays (capacity = template/budget + 1 + suffix): tok, par, score, depth, and the two
# tokens before each node in its path context (ct2, ct1), so a node's lookup key is
# (ct2[v], ct1[v], tok[v]) without walking the path. The root's are history[-3], history[-2].


@njit(cache=True)
def _candidates(v, tok, ct2, ct1, u_rows, ctx_on, tkeys, tvals, bits, mode, priors, k, g,
                out_ids, out_q, out_w, buf_ids, buf_m, taken):
    """Fused top-k candidates for the children of node v; returns their count."""
    r = _gather(ct2[v], ct1[v], tok[v], u_rows, ctx_on, tkeys, tvals, bits, g)
    return _fuse(g, r, mode, priors, k, out_ids, out_q, out_w, buf_ids, buf_m, taken)


@njit(cache=True)
def _edge_on_path(tok, par, v, a, b):
    """True if edge (a -> b) already occurs on the root->v path (v's ancestors, root included)."""
    u = v
    while par[u] >= 0:
        if tok[u] == b and tok[par[u]] == a:
            return True
        u = par[u]
    return False


@njit(cache=True, inline="always")
def _discount(discounts, depth):
    return discounts[min(depth, discounts.shape[0]) - 1]


@njit(cache=True)
def _add_node(n, tok, par, score, depth, ct2, ct1, p, z, s):
    tok[n] = z
    par[n] = p
    score[n] = s
    depth[n] = depth[p] + 1
    ct2[n] = ct1[p]
    ct1[n] = tok[p]
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
def _merge_suffix(n, tok, par, score, depth, ct2, ct1, suffix, suffix_prior, max_depth,
                  discounts, blocked, no_repeat, u_rows, ctx_on, tkeys, tvals, bits, mode,
                  priors, k, g, out_ids, out_q, out_w, buf_ids, buf_m, taken):
    """Walks the suffix continuation from the root, sharing existing nodes, adding the rest.

    Suffix node score = score(parent) * d(depth) * max(q(z | parent context), suffix_prior),
    q = 0 when z is not a fused candidate; a shared node keeps the larger score. Stops at
    max_depth, a blocked token or a repeated edge. A suffix-only child can make its parent
    K + 1 wide; it is "on top of the budget" in width as in count.
    """
    cur = np.int64(0)  # typed, not Literal[int]: one specialisation of each callee
    for i in range(suffix.shape[0]):
        z = suffix[i]
        d = depth[cur] + 1
        if d > max_depth or blocked[z]:
            break
        nc = _candidates(cur, tok, ct2, ct1, u_rows, ctx_on, tkeys, tvals, bits, mode, priors,
                         k, g, out_ids, out_q, out_w, buf_ids, buf_m, taken)
        q = 0.0
        for j in range(nc):
            if out_ids[j] == z:
                q = out_q[j]
                break
        s = score[cur] * _discount(discounts, d) * max(q, suffix_prior)
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
            if no_repeat and _edge_on_path(tok, par, cur, tok[cur], z):
                break
            n = _add_node(n, tok, par, score, depth, ct2, ct1, cur, z, s)
            cur = n - 1
    return n


@njit(cache=True)
def _chain_first(n, tok, par, score, out_tok, out_par, out_score):
    """Re-lays the tree so the best chain (highest-scoring child from the root, ties to the
    lower index) sits at 1..L; the rest keep their order, so parents-first still holds.
    Writes out_*[:n]; returns (n, L)."""
    best = np.full(n, -1, np.int64)
    for u in range(1, n):
        p = par[u]
        if best[p] < 0 or score[u] > score[best[p]]:
            best[p] = u
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
    chain_len = m - 1
    for u in range(1, n):
        if not placed[u]:
            order[m] = u
            m += 1
    new_index = np.empty(n, np.int64)
    for i in range(n):
        new_index[order[i]] = i
    for i in range(n):
        u = order[i]
        out_tok[i] = tok[u]
        out_par[i] = new_index[par[u]] if par[u] >= 0 else -1
        out_score[i] = score[u]
    return n, chain_len


@njit(cache=True)
def build_best_first(root, h2, h1, budget, max_depth, discounts, priors, mode, ctx_on,
                     no_repeat, blocked, u_rows, tkeys, tvals, suffix, suffix_prior, out_tok,
                     out_par, out_score):
    """RECAP best-first tree + suffix merge into out_* (capacity >= budget + 1 + len(suffix)).

    Returns (node count, best chain length). Outputs are caller-owned buffers because boxing
    three fresh arrays back to Python costs more than the 16-node tree itself.
    """
    k = (u_rows.shape[1] - 1) // 2
    bits = table_bits(tkeys.shape[0])
    cap = budget + 1 + suffix.shape[0]
    tok = np.empty(cap, np.int64)
    par = np.empty(cap, np.int64)
    score = np.empty(cap, np.float64)
    depth = np.empty(cap, np.int64)
    ct2 = np.empty(cap, np.int64)
    ct1 = np.empty(cap, np.int64)
    tok[0] = root
    par[0] = -1
    score[0] = 1.0
    depth[0] = 0
    ct2[0] = h2
    ct1[0] = h1
    g = np.empty((3, u_rows.shape[1]), np.float32)
    out_ids = np.empty(k, np.int64)
    out_q = np.empty(k, np.float64)
    out_w = np.empty(3, np.float64)
    buf_ids = np.empty(3 * k, np.int64)
    buf_m = np.empty(3 * k, np.float64)
    taken = np.empty(3 * k, np.bool_)
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
            nc = _candidates(v, tok, ct2, ct1, u_rows, ctx_on, tkeys, tvals, bits, mode,
                             priors, k, g, out_ids, out_q, out_w, buf_ids, buf_m, taken)
            disc = _discount(discounts, depth[v] + 1)
            for j in range(nc):
                z = out_ids[j]
                q = out_q[j]
                if q <= 0.0 or blocked[z]:
                    continue
                if no_repeat and _edge_on_path(tok, par, v, tok[v], z):
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
        n = _add_node(n, tok, par, score, depth, ct2, ct1, c_par[best], c_tok[best],
                      c_score[best])
        v = n - 1
        expand = n <= budget  # the last node added needs no children
    if budget > 0 and suffix.shape[0] > 0:
        n = _merge_suffix(n, tok, par, score, depth, ct2, ct1, suffix, suffix_prior, max_depth,
                          discounts, blocked, no_repeat, u_rows, ctx_on, tkeys, tvals, bits,
                          mode, priors, k, g, out_ids, out_q, out_w, buf_ids, buf_m, taken)
    return _chain_first(n, tok, par, score, out_tok, out_par, out_score)


@njit(cache=True)
def build_template(root, h2, h1, t_par, t_rank, n_template, max_depth, discounts, priors, mode,
                   ctx_on, no_repeat, blocked, u_rows, tkeys, tvals, suffix, suffix_prior,
                   out_tok, out_par, out_score):
    """Static template filled from fused candidates (Token Recycling / FIXED tree ablation).

    Template entry t >= 1 = child of rank t_rank[t] (by q) of entry t_par[t] < t; entry 0 is the
    root; only entries < n_template are used. A missing rank, a blocked token, a repeated edge
    (if no_repeat) or max_depth prunes the entry and its subtree. Then the suffix merges.
    Writes out_* (capacity >= n_template + len(suffix)); returns (node count, chain length).
    """
    k = (u_rows.shape[1] - 1) // 2
    bits = table_bits(tkeys.shape[0])
    cap = n_template + suffix.shape[0]
    tok = np.empty(cap, np.int64)
    par = np.empty(cap, np.int64)
    score = np.empty(cap, np.float64)
    depth = np.empty(cap, np.int64)
    ct2 = np.empty(cap, np.int64)
    ct1 = np.empty(cap, np.int64)
    tok[0] = root
    par[0] = -1
    score[0] = 1.0
    depth[0] = 0
    ct2[0] = h2
    ct1[0] = h1
    g = np.empty((3, u_rows.shape[1]), np.float32)
    out_ids = np.empty(k, np.int64)
    out_q = np.empty(k, np.float64)
    out_w = np.empty(3, np.float64)
    buf_ids = np.empty(3 * k, np.int64)
    buf_m = np.empty(3 * k, np.float64)
    taken = np.empty(3 * k, np.bool_)
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
            cand_n[v] = _candidates(v, tok, ct2, ct1, u_rows, ctx_on, tkeys, tvals, bits,
                                    mode, priors, k, g, cand_ids[v], cand_q[v], out_w,
                                    buf_ids, buf_m, taken)
        rank = t_rank[t]
        if rank >= cand_n[v]:
            continue
        z = cand_ids[v, rank]
        q = cand_q[v, rank]
        if q <= 0.0 or blocked[z]:
            continue
        if no_repeat and _edge_on_path(tok, par, v, tok[v], z):
            continue
        n = _add_node(n, tok, par, score, depth, ct2, ct1, v, z,
                      score[v] * _discount(discounts, depth[v] + 1) * q)
        node_of[t] = n - 1
    if n_template > 1 and suffix.shape[0] > 0:
        n = _merge_suffix(n, tok, par, score, depth, ct2, ct1, suffix, suffix_prior, max_depth,
                          discounts, blocked, no_repeat, u_rows, ctx_on, tkeys, tvals, bits,
                          mode, priors, k, g, out_ids, out_q, out_w, buf_ids, buf_m, taken)
    return _chain_first(n, tok, par, score, out_tok, out_par, out_score)


# --------------------------------------------------------------------------- suffix automaton
#
# Arrays (owned by suffix.SuffixAutomaton): toks [cap] history; per state s_len, s_link,
# s_first (earliest end position), s_head (first outgoing edge); per edge e_tok, e_to, e_next
# (a state's edges form a linked list, needed to copy them into a clone); transitions hashed by
# key state << 21 | token -> edge in hkeys/hvals. meta = (tokens, states, edges, last state).
# Capacity (checked by the caller): states <= 2 n, edges <= 3 n, hash load <= 0.5.


@njit(cache=True)
def _sam_add_edge(p, t, to, s_head, e_tok, e_to, e_next, hkeys, hvals, meta, bits):
    e = meta[2]
    meta[2] += 1
    e_tok[e] = t
    e_to[e] = to
    e_next[e] = s_head[p]
    s_head[p] = e
    key = (np.int64(p) << 21) | t
    slot = -_find(hkeys, key, bits) - 1
    hkeys[slot] = key
    hvals[slot] = e


@njit(cache=True)
def sam_extend(new, toks, s_len, s_link, s_first, s_head, e_tok, e_to, e_next, hkeys, hvals,
               meta):
    """Appends tokens to the automaton (Blumer et al.; amortised O(1) per token)."""
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
            slot = _find(hkeys, (np.int64(p) << 21) | t, bits)
            if slot >= 0:
                e = hvals[slot]
                break
            _sam_add_edge(p, t, cur, s_head, e_tok, e_to, e_next, hkeys, hvals, meta, bits)
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
                s_head[clone] = -1
                f = s_head[q]
                while f >= 0:
                    _sam_add_edge(clone, e_tok[f], e_to[f], s_head, e_tok, e_to, e_next, hkeys,
                                  hvals, meta, bits)
                    f = e_next[f]
                while p != -1:
                    slot = _find(hkeys, (np.int64(p) << 21) | t, bits)
                    if slot < 0 or e_to[hvals[slot]] != q:
                        break
                    e_to[hvals[slot]] = clone
                    p = s_link[p]
                s_link[q] = clone
                s_link[cur] = clone
        meta[3] = cur


@njit(cache=True)
def sam_rehash(s_head, e_tok, e_next, n_states, hkeys, hvals):
    """Rebuilds the transition hash (after it grew) from the per-state edge lists."""
    bits = table_bits(hkeys.shape[0])
    hkeys[:] = EMPTY
    for p in range(n_states):
        e = s_head[p]
        while e >= 0:
            key = (np.int64(p) << 21) | e_tok[e]
            slot = -_find(hkeys, key, bits) - 1
            hkeys[slot] = key
            hvals[slot] = e
            e = e_next[e]
