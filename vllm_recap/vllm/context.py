"""One engine step as one typed object, and the scope that holds it while the step runs.

A step's data used to travel through a module global and untyped tuples. Here it is one
:class:`StepContext`, built by the step driver when vLLM has prepared the step's inputs,
installed in the driver's :class:`StepScope` for exactly that step, read by the attention
backends (which hold a reference to the scope, handed to them at model load) and by the
verifier, and cleared when the step ends or any hook raises.

Pure data: numpy and torch only (importable where vLLM and the numba core are not).
"""
from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

if TYPE_CHECKING:  # the CUDA recompute imports this module where the (numba) core is absent
    from vllm_recap.core.budget import Decision
    from vllm_recap.core.tree import DraftTree
    from vllm_recap.vllm.seeding import SeedStep


@dataclass
class TreeSlot:
    """One request whose drafts RECAP verifies this step: a (non-chain) tree, or -- in a step
    RECAP verifies whole (``StepPlan.verified``) -- a chain or a root alone.

    Attributes:
        batch_index: the request's row in vLLM's input batch.
        query_start: index of its first scheduled token (the root) in the flat token batch.
        parents: [n] parents of the verified nodes (root first, parents[0] = -1).
        depths: [n] node depths (root 0); a node's rotary position is root position + depth.
        ancestor_mask: [n, n] bool, mask[i, j] = node j is node i or one of its ancestors.
    """

    batch_index: int
    query_start: int
    parents: np.ndarray
    depths: np.ndarray
    ancestor_mask: np.ndarray

    @property
    def num_nodes(self) -> int:
        return int(self.parents.shape[0])


@dataclass
class StepPlan:
    """The verification layout of one engine step.

    Attributes:
        req_ids: [B] request ids in batch order.
        num_scheduled: [B] tokens scheduled per request.
        query_starts: [B + 1] cumulative token offsets (vLLM's query_start_loc).
        num_drafts: [B] draft tokens verified per request (0 for prefill / no draft).
        parents: per request, the [1 + num_drafts] parent array of its verified nodes.
        trees: the requests whose nodes are not a chain (need tree attention and acceptance).
        num_computed: [B] tokens already in the KV cache before this step.
        num_prompt: [B] prompt lengths.
        verified: the requests whose acceptance RECAP decides, in batch order: ``trees``
            (the default), or every request of a step RECAP verifies whole, the others as
            chain slots (only attention reads ``trees``).
    """

    req_ids: list[str]
    num_scheduled: np.ndarray
    query_starts: np.ndarray
    num_drafts: np.ndarray
    parents: list[np.ndarray]
    trees: list[TreeSlot]
    num_computed: np.ndarray
    num_prompt: np.ndarray
    verified: list[TreeSlot] = None  # type: ignore[assignment]  # set in __post_init__

    def __post_init__(self) -> None:
        if self.verified is None:
            self.verified = self.trees

    @functools.cached_property
    def logits_starts(self) -> np.ndarray:
        """[B + 1] offsets of each request's rows in the step's logits (1 + drafts each).

        Computed once per plan: the driver reads it per request, and right after the forward
        pass each numpy call on these few numbers costs 10-20 us (caches flushed by the
        model's weights), so recomputing it was ~40 us per read."""
        return np.concatenate([[0], np.cumsum(self.num_drafts + 1)])

    def tree_by_batch_index(self) -> dict[int, TreeSlot]:
        return {t.batch_index: t for t in self.trees}


@dataclass
class StepRows:
    """The target's top-K rows for every evaluated position of one step.

    Attributes:
        ids: [R, K] int64 top-K token ids, R = sum over requests of (1 + drafts).
        probs: [R, K] float32 softmax over the K kept logits.
        node_tokens: [R] int64 the input token at each evaluated position.
    """

    ids: np.ndarray
    probs: np.ndarray
    node_tokens: np.ndarray


class KVWriter(Protocol):
    """What KV compaction needs from an attention implementation (vLLM's own method)."""

    def do_kv_cache_update(self, layer: Any, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...


@dataclass(frozen=True)
class StashedKV:
    """The K/V a tree request's nodes wrote in one attention layer, kept until acceptance is
    known, so accepted off-chain nodes can be copied to the slots of their depth.

    Attributes:
        writer: the layer's attention implementation (writes K/V to slots, vLLM's own op).
        layer: the attention layer (vLLM's ``Attention`` module) passed back to ``writer``.
        kv_cache: that layer's paged cache.
        batch_index: the request's row in the batch.
        key, value: [T, KVH, D] K and V whose rows ``start .. start + n - 1`` are the nodes':
            copies of those rows (``start`` 0), or the layer's own whole tensors where the
            step allows (``StepContext.kv_views``; no per-layer slicing in the forward).
        slots: [T] int64 slots, rows ``start ..`` the nodes' (root first), as ``key``.
        start: the root's row in ``key``, ``value`` and ``slots``.
    """

    writer: KVWriter
    layer: Any
    kv_cache: torch.Tensor
    batch_index: int
    key: torch.Tensor
    value: torch.Tensor
    slots: torch.Tensor
    start: int = 0


@dataclass
class StepTiming:
    """RECAP's own work in this step (seconds), for the proposer cost figures.

    Attributes:
        work: layout, rows, acceptance, memory updates and drafting.
        seeding: the part of ``work`` spent on prompt rows (excluded from the budget's step
            cost: it happens in some steps only and does not depend on the draft count).
        shared_lm_head: prompt rows rode along with the step's own LM-head call and their
            share of its time could not be told (no call of the step's own rows measured
            yet, or a device): the step is no clean cost sample. Where it could, that share
            is counted in ``seeding`` instead.
    """

    work: float = 0.0
    seeding: float = 0.0
    shared_lm_head: bool = False


@dataclass
class StepContext:
    """Everything one engine step carries between the runner seams.

    Attributes:
        plan: the step's layout.
        proposals: request id -> the full tree proposed for this step (its scores and depths
            calibrate the node budget once acceptance is known).
        rows: top-K rows of every evaluated position (after the sampling hook).
        kv_stash: node K/V per tree request and attention layer (filled during the forward).
        accepted: batch index -> accepted node indices (depth order, root excluded) of each
            tree request (after the sampling hook).
        backend_state: per-step data an attention backend derives once from the plan and
            reuses in every layer (its own type; None until the first layer builds it).
        timing: RECAP's own work in this step.
        idle: RECAP skips its per-request work this step (see vllm_recap.vllm.idle.IdleMode).
        decision: the budget's decision that scheduled this step's drafts (None: no drafts,
            a fixed budget, or the scheduler ran other drafts than decided), to learn how the
            step turned out against it.
        seeding: this step's prompt rows (None: nothing to seed), computed in the step's own
            LM-head call where possible (see :mod:`vllm_recap.vllm.seeding`).
        kv_views: the stash may hold views of each layer's K/V instead of copies: the model
            runs eagerly (nothing reuses a layer's buffers before acceptance, as a compiled
            graph's memory plan may) and the step is small (a view keeps the layer's whole
            QKV output alive until then).
    """

    plan: StepPlan
    proposals: dict[str, "DraftTree"] = field(default_factory=dict)
    rows: StepRows | None = None
    kv_stash: list[StashedKV] = field(default_factory=list)
    accepted: dict[int, np.ndarray] = field(default_factory=dict)
    backend_state: Any = None
    timing: StepTiming = field(default_factory=StepTiming)
    idle: bool = False
    decision: "Decision | None" = None
    seeding: "SeedStep | None" = None
    kv_views: bool = False

    @property
    def has_trees(self) -> bool:
        return bool(self.plan.trees)


class StepScope:
    """Holds the context of the step being executed, and nothing between steps.

    Owned by the step driver; the attention backends get a reference at model load and read
    :attr:`current` during the forward. ``install`` replaces whatever an interrupted step left
    behind, ``clear`` runs when a step ends or a hook raises, so no context outlives its step.
    """

    def __init__(self) -> None:
        self._current: StepContext | None = None

    @property
    def current(self) -> StepContext | None:
        return self._current

    def install(self, ctx: StepContext) -> None:
        self._current = ctx

    def clear(self) -> None:
        self._current = None
