"""Per-node sampling for draft trees, with vLLM's sequential sampling semantics on every path.

A tree node n at depth d is position ``prefix + d`` of one hypothetical sequence. Its logits row
is the target's distribution of the token that FOLLOWS node n, so the row conditions on node n's
own token. The "output so far" that vLLM's sampler would see for that row is

    request output tokens + tokens of the draft nodes on the path root -> n
    (root excluded: its token is the last committed token, already in the output; n included)

and its length is ``len(output) + depth[n]``. Every per-position feature (penalties, min_tokens,
multi-token bad words) is evaluated on that list, exactly as ``Sampler.apply_logits_processors``
would for a sequence whose output is that list.

Order of operations, as vLLM 0.32's ``Sampler.forward`` (v1/sample/sampler.py):
allowed-ids mask, bad words, non-argmax-invariant logits processors (MinTokens, then LogitBias;
``BUILTIN_LOGITS_PROCESSORS`` order), penalties (repetition, frequency, presence: vLLM's own
``apply_penalties``); then greedy rows take the argmax; sampled rows are divided by their
temperature, min-p filtered (``MinPLogitsProcessor.apply``'s ops), top-k/top-p filtered (vLLM's
``apply_top_k_top_p`` rules, bit for bit, from each row's k largest logits where that decides
them: :mod:`vllm_recap.vllm.top_k_top_p`) and sampled from the softmax. (vLLM's chain rejection sampler applies
penalties before the masks and skips logit bias and min-p at draft positions; the masks commute
with the penalties, and a speculative engine refuses logit_bias and min_p requests, so chains
and this module agree wherever both run.)

The walks over these rows live in :mod:`vllm_recap.vllm.tree_walk`; which requests may
verify trees at all, in :mod:`vllm_recap.vllm.eligibility`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_recap.core.penalties import penalise_group, rank_candidates
from vllm_recap.vllm.token_history import TokenHistory

# vLLM's _SAMPLING_EPS (v1/sample/sampler.py): a temperature below it means greedy. A copy, so
# that plain greedy trees never import vLLM's sampler modules (tests check they agree); the
# vLLM functions each feature reuses are imported where the feature is applied.
_SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class RequestSampling:
    """One request's sampling state for one step, as vLLM's InputBatch would hold it.

    Token lists are the committed ones (no async ``-1`` placeholders: they are padded out of the
    penalties like vLLM does, but bad words would compare them).
    """

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    temperature: float = 1.0
    """0.0 for greedy requests (vLLM stores 0.0 when ``temperature < _SAMPLING_EPS``)."""
    top_k: int = 0
    """0 or -1: off (vLLM maps anything outside ``(0, vocab)`` to the vocab size)."""
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    """``SamplingParams.all_stop_token_ids`` (EOS included): masked while below min_tokens."""
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    allowed_token_ids: Sequence[int] = ()
    bad_words_token_ids: Sequence[Sequence[int]] = ()
    generator: torch.Generator | None = None
    position_seeds: tuple[int, ...] | None = None
    """Seeded requests where vLLM's draws are replayed (:mod:`vllm_recap.vllm.seeded`): the
    seed of the row at depth d at index d; its rows are drawn with vLLM's op at these seeds,
    not at uniforms from ``generator``. None: uniforms."""
    history: TokenHistory | None = field(default=None, compare=False, repr=False)
    """The request's prompt and output kept between steps (synced to the lists above), for
    :func:`penalise_candidates`; None: read from the lists each time."""

    @classmethod
    def from_params(cls, params, prompt_token_ids: Sequence[int] | None,
                    output_token_ids: Sequence[int],
                    generator: torch.Generator | None = None,
                    history: TokenHistory | None = None,
                    position_seeds: tuple[int, ...] | None = None) -> RequestSampling:
        """Builds the state the way ``InputBatch.add_request`` and the builtin processors do.

        Args:
            params: the request's vLLM ``SamplingParams`` (after the engine added EOS and
                tokenized bad words).
            prompt_token_ids: the prompt; None (prompt embeds) only without repetition penalty.
            output_token_ids: committed output tokens, the root's token last.
            generator: the request's ``torch.Generator`` (seeded requests), else None.
            history: the request's :class:`TokenHistory`, synced here (penalties read it).
            position_seeds: see the attribute (None: draws at uniforms).
        """
        if prompt_token_ids is None:
            if params.repetition_penalty != 1.0:
                raise ValueError("repetition_penalty needs prompt_token_ids (prompt embeds?)")
            prompt_token_ids = ()
        greedy = params.temperature < _SAMPLING_EPS
        if history is not None:
            history.sync(prompt_token_ids, output_token_ids)
        return cls(
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            temperature=0.0 if greedy else float(params.temperature),
            top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            min_tokens=params.min_tokens,
            stop_token_ids=frozenset(params.all_stop_token_ids),
            logit_bias=dict(params.logit_bias or {}),
            allowed_token_ids=tuple(params.allowed_token_ids or ()),
            bad_words_token_ids=tuple(tuple(w) for w in params.bad_words_token_ids or ()),
            generator=generator,
            position_seeds=position_seeds,
            history=history,
        )

    @property
    def is_greedy(self) -> bool:
        """vLLM's greedy rule: the sampler takes the argmax of the penalised logits."""
        return self.temperature < _SAMPLING_EPS

    @property
    def greedy_equivalent(self) -> bool:
        """Argmax decides the token: greedy, or top_k == 1 (exact unless the max is tied)."""
        return self.is_greedy or self.top_k == 1

    @property
    def is_plain(self) -> bool:
        """Greedy with nothing to process: the argmax of the raw row decides."""
        return (self.is_greedy and not self.has_penalties and not self.allowed_token_ids
                and not self.bad_words_token_ids and not self.logit_bias
                and not (self.min_tokens and self.stop_token_ids))

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class TreeBatch:
    """All draft trees of one engine step, concatenated: N nodes, T trees (one per request).

    Attributes:
        req: [N] int64, the node's index into the ``requests`` sequence (e.g. its batch row).
        parent: [N] int64, global parent index, -1 for a root; ``parent[n] < n``.
        token: [N] int64; a root's token is the request's last committed token.
        depth: [N] int64, 0 for roots.
        path_nodes: [N, D] int64, the nodes on root -> n (root excluded, n included) in depth
            order, padded with -1; D = max depth.
        roots: [T] int64, root nodes in node order.
        tree_of: [N] int64, index into ``roots`` of the node's tree.
    """

    req: np.ndarray
    parent: np.ndarray
    token: np.ndarray
    depth: np.ndarray
    path_nodes: np.ndarray
    roots: np.ndarray
    tree_of: np.ndarray

    @classmethod
    def from_parents(cls, req, parent, token) -> TreeBatch:
        """Derives depths and paths; raises ValueError on a malformed forest."""
        req, parent, token = (np.asarray(a, dtype=np.int64).ravel() for a in (req, parent, token))
        n = len(parent)
        if n == 0 or len(req) != n or len(token) != n:
            raise ValueError(f"req, parent, token must be non-empty and equal in length, got "
                             f"{len(req)}, {n}, {len(token)}")
        idx = np.arange(n)
        if np.any(parent >= idx) or np.any(parent < -1) or np.any(req < 0):
            raise ValueError("parent[n] must be -1 or an earlier node; req must be >= 0")
        child = parent >= 0
        if np.any(req[parent[child]] != req[child]):
            raise ValueError("a node's parent belongs to another request")
        roots = np.flatnonzero(~child)
        if len(np.unique(req[roots])) != len(roots):
            raise ValueError("a request has more than one root")
        # Pointer jumping: one vectorised pass per tree level.
        depth = np.zeros(n, dtype=np.int64)
        cur = parent.copy()
        while np.any(cur >= 0):
            live = cur >= 0
            depth[live] += 1
            cur[live] = parent[cur[live]]
        d_max = int(depth.max())
        path_nodes = np.full((n, d_max), -1, dtype=np.int64)
        cur = idx.copy()
        for j in range(d_max):
            pos = depth - 1 - j
            live = pos >= 0           # cur is then a non-root node on n's path
            path_nodes[live, pos[live]] = cur[live]
            cur = np.where(live, parent[cur], cur)
        tree_index = np.zeros(int(req.max()) + 1, dtype=np.int64)
        tree_index[req[roots]] = np.arange(len(roots))
        return cls(req, parent, token, depth, path_nodes, roots, tree_index[req])

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    def path_tokens(self) -> np.ndarray:
        """[N, D] int64: tokens of ``path_nodes``, padded with -1."""
        return np.where(self.path_nodes >= 0, self.token[np.maximum(self.path_nodes, 0)], -1)


def group_by_request(tree: TreeBatch, requests: Sequence[RequestSampling | None]
            ) -> list[tuple[RequestSampling, np.ndarray]]:
    """(request, its node indices ascending) per request of the batch."""
    return _groups(tree.req, requests)


def _groups(req: np.ndarray, requests: Sequence[RequestSampling | None]
            ) -> list[tuple[RequestSampling, np.ndarray]]:
    """(request, the indices i ascending with ``req[i]`` = its index) per request in ``req``."""
    order = np.argsort(req, kind="stable")
    uniq, starts = np.unique(req[order], return_index=True)
    out = []
    for r, nodes in zip(uniq, np.split(order, starts[1:])):
        rs = requests[int(r)] if 0 <= r < len(requests) else None
        if rs is None:
            raise ValueError(f"node request index {int(r)} has no RequestSampling")
        out.append((rs, nodes))
    return out


def rows_and_owner(groups: list[tuple[RequestSampling, np.ndarray]]
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The groups' nodes concatenated [M], and for each the index of its group [M]."""
    rows = np.concatenate([nodes for _, nodes in groups])
    owner = np.concatenate([np.full(len(nodes), i) for i, (_, nodes) in enumerate(groups)])
    return rows, owner


def _padded(rows: list[Sequence[int]], pad: int) -> np.ndarray:
    """[len(rows), max_len] int64, right-padded; negative ids (async placeholders) -> pad."""
    arr = np.full((len(rows), max(1, max(len(r) for r in rows))), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        arr[i, :len(r)] = r
    arr[arr < 0] = pad
    return arr


def process_tree_logits(logits: torch.Tensor, tree: TreeBatch,
                        requests: Sequence[RequestSampling | None],
                        nodes: np.ndarray | None = None) -> torch.Tensor:
    """Each node's row exactly as vLLM's sequential sampler would process it at that position.

    Args:
        logits: [M, V] target logits at the nodes (any float dtype; not modified).
        tree: the step's trees; ``tree.req`` indexes ``requests``.
        requests: per request index, its sampling state (None where no node refers to it).
        nodes: [M] the tree nodes whose rows ``logits`` holds, in that order (default: all N
            nodes, M = N). A row's processing depends on its own node's path only, so a
            subset of rows comes out as those rows of the whole batch would.

    Returns:
        [M, V] float32: for greedy rows the penalised logits vLLM takes the argmax of; for
        sampled rows the temperature-scaled, min-p/top-k/top-p filtered logits vLLM samples from
        (its ``processed_logits``).
    """
    n, vocab = logits.shape
    path = tree.path_tokens()
    req, depth = tree.req, tree.depth
    if nodes is not None:
        nodes = np.asarray(nodes, np.int64)
        path, req, depth = path[nodes], req[nodes], depth[nodes]
    if n != len(req):
        raise ValueError(f"logits has {n} rows for {len(req)} nodes")
    dev = logits.device
    out = logits.to(torch.float32, copy=True)
    groups = _groups(req, requests)  # row indices into out / path / depth

    # 1. allowed_token_ids: -inf outside the list (InputBatch's mask, masked_fill_).
    for rs, nodes in groups:
        if rs.allowed_token_ids:
            mask = torch.ones(vocab, dtype=torch.bool, device=dev)
            mask[list(rs.allowed_token_ids)] = False
            rows = torch.as_tensor(nodes, device=dev)
            out[rows] = out[rows].masked_fill_(mask, float("-inf"))

    # 2. bad words on output + path. Only the last (longest word - 1) output tokens can match,
    #    and keeping at least that many keeps vLLM's length check identical.
    bad_rows: dict[int, Sequence[Sequence[int]]] = {}
    past: dict[int, list[int]] = {}
    for rs, nodes in groups:
        if rs.bad_words_token_ids:
            keep = max(len(w) for w in rs.bad_words_token_ids) - 1
            start = max(0, len(rs.output_token_ids) - keep)
            tail = list(rs.output_token_ids[start:]) if keep else []
            words = [list(w) for w in rs.bad_words_token_ids]
            for v in nodes.tolist():
                bad_rows[v] = words
                past[v] = tail + path[v, :depth[v]].tolist()
    if bad_rows:
        from vllm.v1.sample.ops.bad_words import apply_bad_words

        apply_bad_words(out, bad_rows, past)  # indexes past by row; a dict serves

    # 3. MinTokens (stop ids -> -inf while len(output so far) < min_tokens), then LogitBias.
    mt_rows, mt_toks, lb_rows, lb_toks, lb_vals = [], [], [], [], []
    for rs, nodes in groups:
        if rs.min_tokens and rs.stop_token_ids:
            masked = nodes[len(rs.output_token_ids) + depth[nodes] < rs.min_tokens]
            stops = np.fromiter(rs.stop_token_ids, dtype=np.int64)
            mt_rows.append(np.repeat(masked, len(stops)))
            mt_toks.append(np.tile(stops, len(masked)))
        if rs.logit_bias:
            toks = np.fromiter(rs.logit_bias.keys(), dtype=np.int64)
            vals = np.fromiter(rs.logit_bias.values(), dtype=np.float32)
            lb_rows.append(np.repeat(nodes, len(toks)))
            lb_toks.append(np.tile(toks, len(nodes)))
            lb_vals.append(np.tile(vals, len(nodes)))
    if mt_rows:
        idx = (torch.as_tensor(np.concatenate(mt_rows), device=dev),
               torch.as_tensor(np.concatenate(mt_toks), device=dev))
        out.index_put_(idx, torch.tensor(float("-inf"), device=dev))
    if lb_rows:
        idx = (torch.as_tensor(np.concatenate(lb_rows), device=dev),
               torch.as_tensor(np.concatenate(lb_toks), device=dev))
        out[idx] += torch.as_tensor(np.concatenate(lb_vals), device=dev)

    # 4. Penalties (repetition, frequency, presence) over prompt + output + path. On CPU only
    #    the seen entries (vLLM's CPU ops, bit for bit); elsewhere vLLM's own function (its
    #    CUDA repetition kernel may round differently from the CPU formula), on the penalised
    #    rows only (a neutral row is an exact no-op in vLLM's batch).
    pen = [(rs, nodes) for rs, nodes in groups if rs.has_penalties]
    if pen and dev.type == "cpu":
        apply_penalties_sparse(out, pen, depth, path)
    elif pen:
        from vllm.model_executor.layers.utils import apply_penalties

        rows_np, owner = rows_and_owner(pen)
        prompt = _padded([rs.prompt_token_ids for rs, _ in pen], vocab)[owner]
        output = np.concatenate([_padded([rs.output_token_ids for rs, _ in pen], vocab)[owner],
                                 np.where(path[rows_np] >= 0, path[rows_np], vocab)], axis=1)

        def per_row(attr: str) -> torch.Tensor:  # float32 like InputBatch's penalty tensors
            vals = torch.tensor([getattr(rs, attr) for rs, _ in pen], dtype=torch.float32)
            return vals[torch.as_tensor(owner)].to(dev)

        rows = torch.as_tensor(rows_np, device=dev)
        sub = out[rows]  # a contiguous copy: the CUDA repetition kernel needs contiguity
        out[rows] = apply_penalties(sub, torch.as_tensor(prompt, device=dev),
                                    torch.as_tensor(output, device=dev),
                                    per_row("presence_penalty"), per_row("frequency_penalty"),
                                    per_row("repetition_penalty"))

    # 5. Sampled rows: temperature, min-p, top-k/top-p (Sampler.sample's order).
    samp = [(rs, nodes) for rs, nodes in groups if not rs.is_greedy]
    if samp:
        from vllm.v1.sample.sampler import Sampler

        from vllm_recap.vllm.top_k_top_p import top_k_top_p

        rows_np, owner_np = rows_and_owner(samp)
        owner = torch.as_tensor(owner_np, device=dev)
        rows = torch.as_tensor(rows_np, device=dev)
        sub = Sampler.apply_temperature(
            out[rows], torch.tensor([rs.temperature for rs, _ in samp], dtype=torch.float32,
                                    device=dev)[owner], all_random=True)
        min_p = torch.tensor([rs.min_p for rs, _ in samp], dtype=torch.float32,
                             device=dev)[owner]
        if torch.any(min_p != 0):  # MinPLogitsProcessor.apply, same ops
            probs = torch.nn.functional.softmax(sub, dim=-1)
            adjusted = torch.amax(probs, dim=-1, keepdim=True).mul_(min_p.unsqueeze(1))
            sub.masked_fill_(probs < adjusted, -float("inf"))
        # InputBatch: top_k/top_p tensors exist only when some request uses them.
        ks = [rs.top_k if 0 < rs.top_k < vocab else vocab for rs, _ in samp]
        k = (torch.tensor(ks, dtype=torch.int32, device=dev)[owner]
             if any(x < vocab for x in ks) else None)
        p = (torch.tensor([rs.top_p for rs, _ in samp], dtype=torch.float32, device=dev)[owner]
             if any(rs.top_p < 1 for rs, _ in samp) else None)
        out[rows] = top_k_top_p(sub, k, p)  # vLLM's filter, sorting only where it must
    return out


def apply_penalties_sparse(out: torch.Tensor, groups: list[tuple[RequestSampling, np.ndarray]],
                           depth: np.ndarray, path: np.ndarray) -> None:
    """vLLM's ``apply_penalties`` on CPU on the rows of ``groups``, in place, bit for bit,
    touching only the entries it changes.

    vLLM's function builds [rows, V + 1] count tensors of prompt and output and scales every
    entry; on a 49k-151k vocabulary that was most of a penalised tree step (~2 ms p50 and
    16 ms p99 for ~6 rows with long prompts, bf16 SmolLM2, AMD EPYC 2 cores). An entry no
    token of the row's prompt, output or path names is left exactly as vLLM leaves it (x * 1.0
    - f * 0 - p * 0 = x), so only the seen (row, token) pairs are computed, with vLLM's own ops
    in vLLM's order: ``x * (1 / r if x > 0 else r)`` (float32 reciprocal), then ``- f * count``
    and ``- p * (count > 0)`` over the output (request output + path) counts.

    Args:
        out: [N, V] float32 rows, modified in place.
        groups: (request, its rows of ``out``) for the requests with penalties.
        depth: [N] each row's node depth.
        path: [N, D] each row's path tokens (``TreeBatch.path_tokens``, padded with -1).
    """
    vocab = out.shape[1]
    rows, cols, counts, owner = [], [], [], []
    for g, (rs, nodes) in enumerate(groups):
        prompt = np.asarray(rs.prompt_token_ids, np.int64).reshape(-1)
        output = np.asarray(rs.output_token_ids, np.int64).reshape(-1)
        output = output[(output >= 0) & (output < vocab)]  # async placeholders are padding
        prompt = prompt[(prompt >= 0) & (prompt < vocab)]
        # Entries every node of the request shares: prompt and output tokens, output counts.
        seen, inverse = np.unique(np.concatenate([prompt, output]), return_inverse=True)
        out_count = np.bincount(inverse[prompt.shape[0]:], minlength=seen.shape[0])
        n = nodes.shape[0]
        # Each node's path tokens (root excluded, the node included) add output occurrences.
        node_depth = depth[nodes]
        node_path = path[nodes]
        on_path = np.arange(node_path.shape[1])[None, :] < node_depth[:, None]
        path_rows = np.broadcast_to(nodes[:, None], node_path.shape)[on_path]
        rows.append(np.concatenate([np.repeat(nodes, seen.shape[0]), path_rows]))
        cols.append(np.concatenate([np.tile(seen, n), node_path[on_path]]))
        counts.append(np.concatenate([np.tile(out_count, n),
                                      np.ones(path_rows.shape[0], np.int64)]))
        owner.append(np.full(rows[-1].shape[0], g))
    rows_np, cols_np = np.concatenate(rows), np.concatenate(cols)
    # One entry per (row, token): sum the output counts of duplicates.
    key, first, inverse = np.unique(rows_np * vocab + cols_np, return_index=True,
                                    return_inverse=True)
    count = np.bincount(inverse.reshape(-1), weights=np.concatenate(counts),
                        minlength=key.shape[0]).astype(np.int64)
    owner_np = np.concatenate(owner)[first]
    dev = out.device

    def per_entry(attr: str) -> torch.Tensor:  # float32 like InputBatch's penalty tensors
        vals = torch.tensor([getattr(rs, attr) for rs, _ in groups], dtype=torch.float32)
        return vals[torch.from_numpy(owner_np)].to(dev)

    r_idx = torch.from_numpy(key // vocab).to(dev)
    c_idx = torch.from_numpy(key % vocab).to(dev)
    count_t = torch.from_numpy(count).to(dev)
    vals = out[r_idx, c_idx]
    rep = per_entry("repetition_penalty")
    vals *= torch.where(vals > 0, 1.0 / rep, rep)  # apply_repetition_penalties_torch
    vals -= per_entry("frequency_penalty") * count_t  # apply_penalties
    vals -= per_entry("presence_penalty") * (count_t > 0)
    out[r_idx, c_idx] = vals


def penalties_only(rs: RequestSampling) -> bool:
    """Greedy-equivalent with at most penalties that only lower logits (repetition >= 1,
    frequency and presence >= 0) and nothing else to process: its argmax is decided among the
    raw row's top entries whenever the best penalised one stays above the rest
    (:func:`penalised_top_argmax`)."""
    return rs.greedy_equivalent and lowers_only(rs)


def lowers_only(rs: RequestSampling) -> bool:
    """Its processing never raises a logit and needs nothing but the candidates' ids: penalties
    of the lowering kind, no allow-list, bad words, logit bias or min_tokens mask."""
    return (rs.repetition_penalty >= 1.0 and rs.frequency_penalty >= 0.0
            and rs.presence_penalty >= 0.0 and not rs.allowed_token_ids
            and not rs.bad_words_token_ids and not rs.logit_bias
            and not (rs.min_tokens and rs.stop_token_ids))


def penalised_top_argmax(values: np.ndarray, ids: np.ndarray, owner: np.ndarray,
                         paths: Sequence[Sequence[int]],
                         requests: Sequence[RequestSampling]
                         ) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """The argmax of each penalised row from its raw top-K alone, exactly, when it can be.

    For :func:`penalties_only` requests a penalty never raises a logit, so every entry outside
    a row's raw top K stays <= the K-th raw value v_K. Penalising the K candidates with vLLM's
    CPU ops (as :func:`apply_penalties_sparse`, float32) gives the processed row's argmax
    whenever the best penalised candidate m is > v_K (lowest id among equal candidates, vLLM's
    rule); at m <= v_K an unseen entry outside the top K could tie or win, and the caller
    processes whole rows instead. No [rows, V] copy, count tensor or second top-K.

    Args:
        values: [M, K] float32 raw logits of the rows' top K, largest first.
        ids: [M, K] int64 their token ids.
        owner: [M] index into ``requests`` of each row's request.
        paths: per row, the tokens on its node's path (root excluded, node included).
        requests: the requests (each :func:`penalties_only`).

    Returns:
        argmax [M] int64, or None when some row is undecided; and the memory rows: ids [M, K]
        by penalised value (largest first) and probs [M, K]
        float32, the softmax over those K penalised values (the top K of the processed row
        but for candidates that fell below entries outside the raw top K).
    """
    v = penalise_candidates(values, ids, owner, paths, requests)
    mem_ids, _, probs, argmax, decided = rank_candidates(v, ids, values[:, -1])
    return (argmax if decided else None), mem_ids, probs


def candidate_memory_rows(values: np.ndarray, ids: np.ndarray, owner: np.ndarray,
                          paths: Sequence[Sequence[int]], requests: Sequence[RequestSampling]
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Memory rows of rows not processed whole: each row's raw top-K candidates penalised
    (:func:`penalise_candidates`) and, for sampled rows, divided by the temperature, then
    ranked. The processed row's top K as far as its raw top K shows it (masks and
    top-k/top-p/min-p cuts are not applied). Arguments as :func:`penalised_top_argmax`.

    Returns:
        ids [M, K] by processed value, largest first; probs [M, K] float32, their softmax.
    """
    v = penalise_candidates(values, ids, owner, paths, requests)
    temp = np.array([requests[g].temperature if not requests[g].is_greedy else 1.0
                     for g in owner.tolist()], np.float32)
    mem_ids, _, probs, _, _ = rank_candidates(v / temp[:, None], ids)
    return mem_ids, probs


def penalise_candidates(values: np.ndarray, ids: np.ndarray, owner: np.ndarray,
                        paths: Sequence[Sequence[int]],
                        requests: Sequence[RequestSampling]) -> np.ndarray:
    """vLLM's CPU penalties (repetition, frequency, presence) on some entries of each row.

    The same float32 ops in the same order as :func:`apply_penalties_sparse`, on the
    candidates only: over prompt + output + the node's path for the repetition penalty, over
    output + path for the others (compiled: :func:`vllm_recap.core.penalties.penalise_group`).

    Args:
        values: [M, K] raw logits (float32 after the model dtype) of the candidates.
        ids: [M, K] int64 their token ids.
        owner: [M] index into ``requests`` of each row's request.
        paths: per row, the tokens on its node's path (root excluded, node included).
        requests: the requests.

    Returns:
        [M, K] float32 penalised values (rows of requests without penalties unchanged).
    """
    v = np.array(values, np.float32)  # a copy, penalised in place
    ids = np.ascontiguousarray(ids, np.int64)
    groups: dict[int, list[int]] = {}
    for r, g in enumerate(owner.tolist()):
        groups.setdefault(g, []).append(r)
    for g, rows in groups.items():
        rs = requests[g]
        if not rs.has_penalties:
            continue
        cand = ids if len(rows) == len(ids) else ids[rows]
        if rs.history is not None:
            counts, prompt = rs.history.output_counts(cand), rs.history.prompt_tokens
        else:
            output = np.asarray(rs.output_token_ids, np.int64).reshape(-1)
            out_tok, out_cnt = np.unique(output[output >= 0], return_counts=True)
            at = np.minimum(np.searchsorted(out_tok, cand), max(len(out_tok) - 1, 0))
            counts = (np.where(out_tok[at] == cand, out_cnt[at], 0) if len(out_tok)
                      else np.zeros_like(cand))
            prompt = np.unique(np.asarray(rs.prompt_token_ids, np.int64).reshape(-1))
        depth = max(1, max(len(paths[r]) for r in rows))
        path = np.array([list(paths[r]) + [-1] * (depth - len(paths[r])) for r in rows],
                        np.int64)
        penalise_group(v, ids, np.asarray(rows, np.int64), np.ascontiguousarray(counts),
                       prompt, path, rs.repetition_penalty, rs.frequency_penalty,
                       rs.presence_penalty)
    return v
