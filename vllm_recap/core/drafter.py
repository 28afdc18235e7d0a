"""The drafter: RECAP (or Token Recycling) behind a lifecycle API keyed by request id.

    start(req, prompt[, prompt rows])      request-local memories + suffix automaton
    loop:
        propose(req) -> DraftTree          tree rooted at history[-1]
        (engine verifies the tree)
        observe(req, tree, top-K rows)     every evaluated node updates the memories
        commit(req, accepted + bonus)      only committed tokens extend the history
    stop(req)                              frees request-local state; publishes the output
                                           to the shared continuation index

`observe` must come before the matching `commit`: node 0 of an observed step is the root, the
last token of the history *before* the commit. Misuse raises ValueError. Not thread-safe: one
engine thread drives a drafter.

Learning what a node is worth: when `observe` receives a prefix of the request's last
proposal, the following `commit` says which of those nodes held (the committed tokens walk
the accepted path), and the calibration (calibration.py) counts every node whose parent held,
per source and evidence cell. `acceptance_snapshot` gives the per-source, per-depth counts.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from vllm_recap.core import _kernels as kernels
from vllm_recap.core import candidates, penalties, topk
from vllm_recap.core.calibration import SourceCalibration
from vllm_recap.core.config import (
    MAX_DEPTH,
    MAX_VOCAB_SIZE,
    Policy,
    RecapConfig,
    SharedIndexMode,
    SuffixMode,
    TreeShape,
    discount_table,
)
from vllm_recap.core.fusion import FUSION_CODES, fuse
from vllm_recap.core.index import RESYNC_TOKENS, SharedIndex, SharedIndexPartitions
from vllm_recap.core.memory import (
    ContextStore,
    UnigramPartitions,
    UnigramTable,
    empty_context_arrays,
)
from vllm_recap.core.recycling import TEMPLATE_PARENTS, TEMPLATE_RANKS
from vllm_recap.core.suffix import SuffixAutomaton
from vllm_recap.core.tree import DraftTree

_OBSERVE_ERRORS = {
    1: "parents must satisfy parents[0] == -1 and 0 <= parents[i] < i",
    2: "a node token is outside [0, vocab_size)",
    3: "a top-K id is outside [0, vocab_size)",
    4: "top-K probabilities must be finite, >= 0, with a positive sum per row",
}


class _Request:
    # memories: the kernels' `Memories` bundle over unigram and ctx, kept so a step does not
    # rebuild it (see `Drafter._memories`). index/index_gen/index_match: the shared index the
    # request reads, the corpus generation its match was computed on, and the match [2] =
    # (state, length). pending: the last proposal (tokens, parents, depths, feats) while it
    # may still be verified; verified: how many of its nodes `observe` saw (0 = none yet).
    __slots__ = ("history", "sam", "ctx", "unigram", "salt", "memories", "prompt_len",
                 "index", "index_gen", "index_match", "pending", "verified")

    def __init__(self, history: list[int], ctx: ContextStore | None, unigram: UnigramTable,
                 salt: Hashable, memories: tuple) -> None:
        self.history = history
        self.sam: SuffixAutomaton | None = None
        self.ctx = ctx
        self.unigram = unigram
        self.salt = salt
        self.memories = memories
        self.prompt_len = len(history)
        self.index: SharedIndex | None = None
        self.index_gen = -1
        self.index_match = np.zeros(2, np.int64)
        self.pending: tuple[np.ndarray, ...] | None = None
        self.verified = 0


class Drafter:
    """Proposes draft trees for many concurrent requests from recycled target predictions.

    Args:
        config: algorithm knobs (validated).
        vocab_size: target vocabulary size V (< 2**21); token ids must lie in [0, V).
        blocked_token_ids: ids never drafted (image/video placeholders).
    """

    def __init__(self, config: RecapConfig, vocab_size: int,
                 blocked_token_ids: Iterable[int] = ()) -> None:
        if not isinstance(config, RecapConfig):
            raise ValueError(f"config must be a RecapConfig, got {type(config).__name__}")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or not (
            1 <= vocab_size < MAX_VOCAB_SIZE
        ):
            raise ValueError(f"vocab_size = {vocab_size!r} must be an int in [1, {MAX_VOCAB_SIZE})")
        self.config = config
        self.vocab_size = int(vocab_size)
        blocked = np.asarray(list(blocked_token_ids), np.int64)
        if blocked.size and (blocked.min() < 0 or blocked.max() >= vocab_size):
            raise ValueError(f"blocked_token_ids must lie in [0, {vocab_size}), got {blocked}")
        self._blocked = np.zeros(self.vocab_size, np.bool_)
        self._blocked[blocked] = True

        tr = config.policy is Policy.TOKEN_RECYCLING
        self._k = config.top_k
        # Token Recycling = U only, raw adjacency rows, static template, no suffix, and (as in
        # the original) no repeated-edge rule.
        self._ctx_on = config.use_context_memories and not tr
        fusion = kernels.FUSE_BACKOFF if tr else FUSION_CODES[config.fusion]
        self._template = tr or config.tree_shape is TreeShape.FIXED
        self._suffix_len = 0 if tr else config.suffix_len
        # Evidence-scaled continuations and one calibrated score (best-first RECAP only; the
        # template builders keep the original suffix insertion).
        self._evidence = not self._template and config.suffix_mode is SuffixMode.EVIDENCE
        self._calibration = SourceCalibration(config.calibrated_scores)
        self._shared = (
            SharedIndexPartitions(config.shared_index_tokens, config.max_partitions)
            if self._evidence and self._suffix_len > 0
            and config.shared_index is not SharedIndexMode.OFF else None
        )
        self._publish_prompts = config.shared_index is SharedIndexMode.OUTPUTS_AND_PROMPTS
        self._no_match = SuffixAutomaton().arrays()  # placeholder automaton (state 0 = none)
        self._min_prob = float(config.suffix_min_prob)
        # kernels.DraftParams at the configured max_depth (`propose` may override it). A float
        # suffix_prior even if given as an int, or the builders would compile twice.
        self._params = (config.max_depth, discount_table(config.depth_discounts),
                        np.asarray(config.priors, np.float64), fusion, not tr, self._blocked,
                        float(config.suffix_prior))
        self._partitions = (
            UnigramPartitions(self.vocab_size, self._k, config.max_partitions)
            if config.persistent_unigram else None
        )
        self._empty_ctx = empty_context_arrays(self._k)
        self._no_suffix = np.zeros(0, np.int64)
        self._requests: dict[str, _Request] = {}
        # Hot-path copies of config values (attribute chains cost more than the 16-node tree).
        self._budget = config.node_budget
        self._depth = config.max_depth
        self._suffix_min_match = config.suffix_min_match
        self._template_arrays = (TEMPLATE_PARENTS, TEMPLATE_RANKS)
        self._allocate_outputs(1 + max(config.node_budget, len(TEMPLATE_PARENTS))
                               + config.suffix_len)
        self._stats = {"published": 0}

    # ------------------------------------------------------------------ lifecycle

    def start(self, req_id: str, prompt_tokens: Sequence[int],
              prompt_rows: tuple[np.ndarray, ...] | None = None, salt: Hashable = None) -> None:
        """Registers a request whose history is its prompt.

        Args:
            req_id: request id, unique among running requests.
            prompt_tokens: [p] prompt token ids, p >= 1.
            prompt_rows: optional (ids [m, K], probs [m, K][, positions [m]]): row i is the
                target's top-K prediction after prompt[:positions[i] + 1], stored under the
                contexts ending at prompt[positions[i]]. Without positions, rows are for
                positions 0..m-1 (m <= p). Lets an engine pass rows for a subset of positions.
            salt: persistent-U and shared-index partition (vLLM's cache_salt, or any other
                hashable key the engine partitions by); None = the default partition.

        Raises:
            ValueError: double start, empty prompt, ids out of range, malformed rows.
        """
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already started")
        prompt = np.asarray(prompt_tokens, np.int64).reshape(-1)
        if prompt.size == 0:
            raise ValueError(f"request {req_id!r}: prompt_tokens must not be empty")
        self._check_tokens(req_id, "prompt_tokens", prompt)
        unigram = (self._partitions.get(salt) if self._partitions is not None
                   else UnigramTable(self.vocab_size, self._k))
        ctx = ContextStore(self._k, self.config.max_context_rows) if self._ctx_on else None
        memories = (unigram.rows, True, *ctx.arrays()) if ctx is not None else (
            unigram.rows, False, *self._empty_ctx)
        req = _Request(prompt.tolist(), ctx, unigram, salt, memories)
        if prompt_rows is not None:
            self._seed(req_id, prompt, prompt_rows, req)
        req.sam = SuffixAutomaton(prompt) if self._suffix_len > 0 else None
        if self._shared is not None:
            req.index = self._shared.get(salt)
            req.index.match(prompt, req.index_match)
            req.index_gen = req.index.generation
        self._requests[req_id] = req

    def add_prompt_rows(self, req_id: str, prompt_rows: tuple[np.ndarray, ...]) -> None:
        """Stores prompt rows of a request that already started (an engine that computes
        them over several steps): as ``prompt_rows`` of :meth:`start`, with positions.

        Raises:
            ValueError: unknown request, malformed rows, positions outside the history.
        """
        req = self._get(req_id)
        if not isinstance(prompt_rows, (tuple, list)) or len(prompt_rows) != 3:
            raise ValueError(f"request {req_id!r}: add_prompt_rows takes (ids, probs, positions)")
        self._seed(req_id, np.asarray(req.history, np.int64), prompt_rows, req)

    def observe(self, req_id: str, node_tokens: np.ndarray, parents: np.ndarray,
                topk_ids: np.ndarray, topk_probs: np.ndarray) -> None:
        """Stores the target's rows for one verified step (every evaluated node).

        Args:
            req_id: a started request.
            node_tokens: [n] int; node 0 = the root = history[-1] (before this step's commit).
            parents: [n] int, parents[0] == -1, parents[i] < i.
            topk_ids: [n, K] int, row i = the target's top-K after node i's context
                (history + path root->i).
            topk_probs: [n, K] float, renormalised over the K (renormalised again here).

        Raises:
            ValueError: unknown request, root mismatch, malformed or out-of-range input.
        """
        req = self._get(req_id)
        tokens = np.ascontiguousarray(node_tokens, np.int64)
        parents = np.ascontiguousarray(parents, np.int64)
        ids = np.ascontiguousarray(topk_ids, np.int64)
        probs = np.ascontiguousarray(topk_probs, np.float32)
        n = tokens.shape[0] if tokens.ndim == 1 else 0
        k = self._k
        if n == 0 or parents.shape != (n,) or ids.shape != (n, k) or probs.shape != (n, k):
            raise ValueError(
                f"request {req_id!r}: expected node_tokens [n>=1], parents [n], topk_ids and "
                f"topk_probs [n, {self._k}]; got {tokens.shape}, {parents.shape}, {ids.shape}, "
                f"{probs.shape}"
            )
        hist = req.history
        if tokens[0] != hist[-1]:
            raise ValueError(
                f"request {req_id!r}: node_tokens[0] = {int(tokens[0])} is not the last history "
                f"token {hist[-1]} (observe a step before committing it)"
            )
        if req.ctx is not None:
            req.ctx.reserve(2 * n)
        h2 = hist[-3] if len(hist) >= 3 else -1
        h1 = hist[-2] if len(hist) >= 2 else -1
        status = kernels.observe_tree(tokens, parents, h2, h1, ids, probs, self._memories(req))
        if status:
            raise ValueError(f"request {req_id!r}: observe: {_OBSERVE_ERRORS[status]}")
        pending = req.pending
        if pending is not None and n > 1:
            if kernels.same_prefix(tokens, parents, pending[0], pending[1]):
                req.verified = n
            else:  # laid out otherwise (best node first), or something else entirely
                req.pending = _verified_subtree(tokens, parents, pending)
                req.verified = n if req.pending is not None else 0

    def commit(self, req_id: str, tokens: Sequence[int]) -> None:
        """Appends committed tokens (accepted drafts + bonus) to the history."""
        req = self._get(req_id)
        new = [int(t) for t in tokens]
        for t in new:
            if not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"request {req_id!r}: committed token {t} outside [0, {self.vocab_size})")
        committed = np.array(new, np.int64)
        if req.pending is not None:
            if req.verified:
                tokens, parents, depths, feats = req.pending
                self._calibration.learn_step(tokens, parents, depths, feats, req.verified,
                                             committed)
            req.pending = None
            req.verified = 0
        req.history.extend(new)
        if req.sam is not None:
            req.sam.extend(committed)
        index = req.index
        if index is not None and index.generation == req.index_gen:
            index.sam.match_against(committed, req.index_match)

    def propose(self, req_id: str, node_budget: int | None = None,
                max_depth: int | None = None) -> DraftTree:
        """Builds a draft tree rooted at history[-1].

        Args:
            req_id: a started request.
            node_budget: memory draft nodes, continuations not counted (default
                config.node_budget). 0 with suffix_mode evidence gives continuations only (they
                come on top of the budget, as `RecapConfig.suffix_len` says); in the other
                modes, whose continuation is inserted into a tree of memory nodes, a
                root-only tree.
            max_depth: deepest level, at most MAX_DEPTH (default config.max_depth); 0 gives a
                root-only tree.

        Returns:
            DraftTree: parents-first, best chain at 1..L, depths filled in, no blocked token,
            width <= K (the suffix path may add one more child to a node), depth <= max_depth,
            and (RECAP) no edge (parent token, child token) repeated on a root->node path.
        """
        req = self._get(req_id)
        budget = self._budget if node_budget is None else _nonneg("node_budget", node_budget)
        depth = self._depth if max_depth is None else _nonneg("max_depth", max_depth)
        if depth > MAX_DEPTH:  # the discount table (and every per-depth array) ends there
            raise ValueError(f"propose: max_depth = {depth} must be <= MAX_DEPTH = {MAX_DEPTH}")
        hist = req.history
        root = hist[-1]
        req.pending = None
        req.verified = 0
        if depth == 0:
            return DraftTree.root_only(root)
        if self._evidence and (budget or self._suffix_len):
            return self._propose_evidence(req, budget, depth, max_depth is not None)
        if budget == 0:
            return DraftTree.root_only(root)
        suffix = self._no_suffix
        if req.sam is not None:
            suffix = req.sam.continuation(self._suffix_len, self._suffix_min_match)
        if 1 + budget + suffix.shape[0] > self._out_scores.shape[0]:
            self._allocate_outputs(1 + budget + suffix.shape[0])
        hist3 = (root, hist[-3] if len(hist) >= 3 else -1, hist[-2] if len(hist) >= 2 else -1)
        params = self._params if max_depth is None else (depth, *self._params[1:])
        memories = self._memories(req)
        out_ints, out_scores = self._out_ints, self._out_scores
        if self._template:
            n_template = min(budget, TEMPLATE_PARENTS.shape[0] - 1) + 1
            n, chain = kernels.build_template(hist3, self._template_arrays, n_template, params,
                                              memories, suffix, out_ints, out_scores)
        else:
            n, chain = kernels.build_best_first(hist3, budget, params, memories, suffix,
                                                out_ints, out_scores)
        ints = out_ints[:3, :n].copy()  # one copy for tokens, parents and depths
        return DraftTree(ints[0], ints[1], out_scores[:n].copy(), chain, ints[2])

    def _propose_evidence(self, req: _Request, budget: int, depth: int,
                          depth_given: bool) -> DraftTree:
        """`propose` with suffix_mode evidence: one best-first tree over every source."""
        hist = req.history
        root = hist[-1]
        allowance = self._suffix_len
        v_l = m_l = v_s = m_s = 0
        if req.sam is not None:
            v_l, m_l = req.sam.matched()
            if m_l < self._suffix_min_match:
                v_l = 0
        st_l, ed_l = req.sam.arrays() if req.sam is not None else self._no_match
        index = req.index
        st_s, ed_s = self._no_match
        if index is not None and len(index):
            if index.generation != req.index_gen:  # the corpus changed: match again
                index.match(np.array(hist[-RESYNC_TOKENS:], np.int64), req.index_match)
                req.index_gen = index.generation
            v_s, m_s = int(req.index_match[0]), int(req.index_match[1])
            if m_s < self._suffix_min_match:
                v_s = 0
            st_s, ed_s = index.sam.arrays()
        cap = 1 + budget + allowance
        if cap > self._out_scores.shape[0]:
            self._allocate_outputs(cap)
        hist3 = (root, hist[-3] if len(hist) >= 3 else -1, hist[-2] if len(hist) >= 2 else -1)
        params = self._params if not depth_given else (depth, *self._params[1:])
        suf_depth = min(MAX_DEPTH, max(depth, allowance))
        out_ints, out_scores, out_feats = self._out_ints, self._out_scores, self._out_feats
        n, chain = kernels.build_evidence(
            hist3, (budget, allowance, suf_depth, self._min_prob), params, self._memories(req),
            (st_l, ed_l, v_l, m_l, st_s, ed_s, v_s, m_s), self._calibration.kernel_args(),
            out_ints, out_scores, out_feats)
        ints = out_ints[:, :n].copy()
        tree = DraftTree(ints[0], ints[1], out_scores[:n].copy(), chain, ints[2], ints[3])
        if n > 1:
            req.pending = (tree.tokens, tree.parents, tree.depths, out_feats[:, :n].copy())
        return tree

    def matched_length(self, req_id: str) -> int:
        """How many of the request's last tokens occurred before, in its own history or (while
        its match is current) in the shared index: the evidence a continuation would start
        from, read without building a tree (0 when neither has a match; a few microseconds).
        Continuations follow longer matches more often: on greedy SmolLM2 Spec-Bench outputs
        the next token followed 18% of 1-token matches, 43% of 2-token ones and 69-93% of
        longer ones."""
        req = self._get(req_id)
        own = req.sam.matched()[1] if req.sam is not None else 0
        index = req.index
        shared = (int(req.index_match[1]) if index is not None and len(index)
                  and index.generation == req.index_gen else 0)
        return max(own, shared)

    def stop(self, req_id: str) -> None:
        """Frees the request's local state (C, G, suffix automaton, private U) and publishes
        its output (with its prompt, if configured) to its partition's shared index."""
        req = self._requests.pop(req_id, None)
        if req is None:
            raise ValueError(f"unknown request {req_id!r}")
        if self._shared is not None and len(req.history) > req.prompt_len:
            start = 0 if self._publish_prompts else req.prompt_len
            self._shared.get(req.salt).publish(np.array(req.history[start:], np.int64))
            self._stats["published"] += 1

    # ------------------------------------------------------------------ introspection

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def history(self, req_id: str) -> list[int]:
        """A copy of the request's prompt + committed tokens."""
        return list(self._get(req_id).history)

    def unigram_table(self, req_id: str) -> UnigramTable:
        """The U table the request reads and writes (shared per salt when persistent)."""
        return self._get(req_id).unigram

    def context_store(self, req_id: str) -> ContextStore | None:
        """The request's C/G store (None when context memories are off)."""
        return self._get(req_id).ctx

    def acceptance_snapshot(self) -> dict[str, dict[str, list[float]]]:
        """Acceptance per node source and depth since this drafter started (suffix_mode
        evidence; see `SourceCalibration.snapshot`): for "memory", "suffix" and "shared",
        lists by depth 1, 2, ... of nodes tested (parent accepted), held, the rate and the
        mean probability the calibration predicted."""
        return self._calibration.snapshot()

    @property
    def calibration(self) -> SourceCalibration:
        """The drafter's calibration table (shared by all its requests)."""
        return self._calibration

    def shared_index(self, salt: Hashable = None) -> SharedIndex | None:
        """The shared continuation index of a partition (None when it is off)."""
        return self._shared.get(salt) if self._shared is not None else None

    def memory_stats(self) -> dict[str, int]:
        """Sizes for benchmarks: U tables (partitions + private), C/G rows and bytes, shared
        index partitions, tokens and bytes."""
        tables = {id(t): t for t in (self._partitions.tables() if self._partitions else [])}
        for req in self._requests.values():
            tables.setdefault(id(req.unigram), req.unigram)
        ctxs = [r.ctx for r in self._requests.values() if r.ctx is not None]
        return {
            "requests": len(self._requests),
            "u_partitions": len(self._partitions) if self._partitions else 0,
            "u_tables": len(tables),
            "u_bytes": sum(t.nbytes for t in tables.values()),
            "context_rows": sum(c.num_rows for c in ctxs),
            "context_bytes": sum(c.nbytes for c in ctxs),
            "history_tokens": sum(len(r.history) for r in self._requests.values()),
            "index_partitions": len(self._shared) if self._shared else 0,
            "index_tokens": sum(len(i) for i in self._shared.indexes()) if self._shared else 0,
            "index_bytes": sum(i.nbytes for i in self._shared.indexes()) if self._shared else 0,
            "index_published": self._stats["published"],
        }

    # ------------------------------------------------------------------ helpers

    def _get(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise ValueError(f"unknown request {req_id!r}")
        return req

    def _allocate_outputs(self, size: int) -> None:
        # Kernel output buffers, reused across calls (tokens, parents and depths share one
        # array so a DraftTree needs two copies, not four); each tree gets copies of the first
        # n entries.
        self._out_ints = np.empty((4, size), np.int64)  # row 3: source bits (evidence)
        self._out_scores = np.empty(size, np.float64)
        self._out_feats = np.empty((3, size), np.int64)

    @staticmethod
    def _memories(req: _Request) -> tuple:
        """The request's `Memories` bundle (a plain tuple: cheaper for numba to type), rebuilt
        only after its C/G table grew, which replaces the table's arrays."""
        ctx = req.ctx
        if ctx is not None and req.memories[2] is not ctx.tkeys:
            req.memories = (req.unigram.rows, True, *ctx.arrays())
        return req.memories

    def _check_tokens(self, req_id: str, name: str, tokens: np.ndarray) -> None:
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"request {req_id!r}: {name} must lie in [0, {self.vocab_size})")

    def _seed(self, req_id: str, prompt: np.ndarray, prompt_rows: tuple[np.ndarray, ...],
              req: _Request) -> None:
        if not isinstance(prompt_rows, (tuple, list)) or len(prompt_rows) not in (2, 3):
            raise ValueError(
                f"request {req_id!r}: prompt_rows must be (ids, probs) or (ids, probs, positions)")
        ids = np.ascontiguousarray(prompt_rows[0], np.int64)
        probs = np.ascontiguousarray(prompt_rows[1], np.float32)
        m = ids.shape[0] if ids.ndim == 2 else -1
        if m < 0 or ids.shape != (m, self._k) or probs.shape != (m, self._k):
            raise ValueError(
                f"request {req_id!r}: prompt_rows ids/probs must be [m, {self._k}], got "
                f"{ids.shape}, {probs.shape}")
        if len(prompt_rows) == 3:
            pos = np.asarray(prompt_rows[2], np.int64).reshape(-1)
            if pos.shape != (m,):
                raise ValueError(f"request {req_id!r}: positions must be [{m}], got {pos.shape}")
        else:
            pos = np.arange(m, dtype=np.int64)
        if m and (pos.min() < 0 or pos.max() >= prompt.size):
            raise ValueError(
                f"request {req_id!r}: prompt_rows positions must lie in [0, {prompt.size})")
        padded = np.concatenate([np.full(2, -1, np.int64), prompt])
        ctx3 = np.stack([padded[pos], padded[pos + 1], padded[pos + 2]], axis=1)
        if req.ctx is not None:
            req.ctx.reserve(2 * m)
        status = kernels.observe_contexts(ctx3, ids, probs, self._memories(req))
        if status:
            raise ValueError(f"request {req_id!r}: prompt_rows: {_OBSERVE_ERRORS[status]}")


def _verified_subtree(tokens: np.ndarray, parents: np.ndarray,
                      pending: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...] | None:
    """The pending proposal restricted to the verified tree's nodes, in the verified layout,
    when that tree is a subtree of the proposal laid out otherwise: an engine that verifies
    part of a tree (the adaptive node budget) lays the best nodes first, and the calibration
    must learn from it as from the proposal's own layout. None when some verified node is not
    the proposal's (it then says nothing about the proposal).

    Args:
        tokens, parents: [n] the verified tree (parents first).
        pending: the proposal's (tokens, parents, depths, feats [F, m]).

    Returns:
        (tokens, parents, depths, feats [F, n]) of the matched nodes, or None.
    """
    p_tokens, p_parents, p_depths, p_feats = pending
    if tokens[0] != p_tokens[0]:
        return None
    child: dict[tuple[int, int], int] = {}  # (proposal parent, token) -> proposal node
    for j, (parent, token) in enumerate(zip(p_parents.tolist(), p_tokens.tolist())):
        if j:
            child.setdefault((parent, token), j)
    index = [0]
    for parent, token in zip(parents.tolist()[1:], tokens.tolist()[1:]):
        j = child.get((index[parent], token))
        if j is None:
            return None
        index.append(j)
    if len(set(index)) != len(index):  # a node verified twice: not a layout of a subtree
        return None
    idx = np.array(index, np.int64)
    return p_tokens[idx], parents.copy(), p_depths[idx], p_feats[:, idx]


def _nonneg(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"propose: {name} = {value!r} must be an int >= 0")
    return int(value)


def warmup() -> float:
    """Compiles (or loads from numba's cache) every kernel with real, non-empty inputs.

    Call once at engine start so no request pays compilation. Returns seconds spent.
    """
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    vocab, k = 64, 8
    for cfg in (RecapConfig(node_budget=16),
                RecapConfig(node_budget=16, suffix_mode=SuffixMode.EARLIEST),
                RecapConfig(node_budget=16, tree_shape=TreeShape.FIXED),
                RecapConfig(node_budget=16, policy=Policy.TOKEN_RECYCLING)):
        drafter = Drafter(cfg, vocab, blocked_token_ids=[vocab - 1])
        prompt = rng.integers(0, vocab - 1, 24).tolist()
        rows = (rng.integers(0, vocab, (24, k)), rng.random((24, k)), np.arange(24))
        for _ in range(2):  # the second request reads the first one's shared output
            drafter.start("warmup", prompt + prompt, prompt_rows=rows)
            for _ in range(3):
                tree = drafter.propose("warmup")
                n = tree.num_nodes
                drafter.observe("warmup", tree.tokens, tree.parents,
                                rng.integers(0, vocab, (n, k)), rng.random((n, k)))
                drafter.commit("warmup", [int(tree.tokens[min(1, n - 1)]),
                                          int(rng.integers(0, vocab - 1))])
            drafter.stop("warmup")
    DraftTree(tree.tokens, tree.parents, tree.scores)  # best_chain_length (trees built by hand)
    DraftTree(np.arange(3), np.array([-1, 0, 0]), np.array([1.0, 0.4, 0.5])).best_first()
    fuse(np.arange(16).reshape(2, 8), np.ones((2, 8)))  # fuse_rows
    store = ContextStore(k, 4 * ContextStore.INITIAL_ROWS)
    store.reserve(2 * ContextStore.INITIAL_ROWS)  # compiles rehash
    store.row((1, 2, 3))
    SuffixAutomaton(np.arange(3 * SuffixAutomaton.INITIAL_TOKENS) % 7).continuation(4)  # + rehash
    topk.warmup()  # the engine's top-K rows
    penalties.warmup()  # penalised tree rows (repetition / frequency / presence penalties)
    candidates.warmup()  # sampled tree rows (temperature, top-k / top-p, the draw)
    from vllm_recap.core.budget import AcceptanceCalibration  # the budget's calibration kernels

    calibration = AcceptanceCalibration(RecapConfig().depth_discounts)
    calibration.observe(tree.depths, tree.scores, np.arange(1, tree.num_nodes), tree.sources)
    calibration.probability_list(tree.depths, tree.parents, tree.scores, tree.sources)
    return time.perf_counter() - t0
