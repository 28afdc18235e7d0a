"""What the adapter keeps per request between engine steps, and its lifecycle.

The drafter (``vllm_recap.core``) owns a request's memories and history; this module owns the
vLLM-side facts around it: the request's cache salt, the tree proposed for its next step,
prompt rows collected during prefill, and how many tokens the drafter's history holds (so a
step in which vLLM did not call the proposer is caught up from vLLM's own token history).
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm_recap.core.drafter import Drafter
from vllm_recap.core.tree import DraftTree
from vllm_recap.vllm.eligibility import SamplingFacts
from vllm_recap.vllm.seeded import SeedStream
from vllm_recap.vllm.token_history import TokenHistory


@dataclass
class PromptSeed:
    """Top-K rows of prompt positions, collected chunk by chunk during prefill.

    Attributes:
        seen: sorted int64 distinct prompt tokens already chosen (first occurrence only).
        num_rows: rows chosen so far (capped by ``prompt_seed_rows``).
        pending: chosen positions whose rows are not computed yet: ([m] positions,
            [m, hidden] their last hidden states, copied out of the step that computed them).
        positions, ids, probs: computed rows waiting for the drafter to start the request:
            per batch, [m] positions, [m, K] ids, [m, K] probs.
    """

    seen: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    num_rows: int = 0
    pending: list[tuple[np.ndarray, torch.Tensor]] = field(default_factory=list)
    positions: list[np.ndarray] = field(default_factory=list)
    ids: list[np.ndarray] = field(default_factory=list)
    probs: list[np.ndarray] = field(default_factory=list)

    @property
    def num_pending(self) -> int:
        return sum(len(p) for p, _ in self.pending)

    def add(self, positions: np.ndarray, ids: np.ndarray, probs: np.ndarray) -> None:
        self.positions.append(positions)
        self.ids.append(ids)
        self.probs.append(probs)

    def take(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(ids [m, K], probs [m, K], positions [m]) for ``Drafter.start``, once; then None."""
        if not self.positions:
            return None
        rows = (np.concatenate(self.ids), np.concatenate(self.probs),
                np.concatenate(self.positions))
        self.positions, self.ids, self.probs = [], [], []
        return rows


class GrammarPartition(NamedTuple):
    """The persistent-memory partition of structured-output requests with this ``cache_salt``.

    Their rows come from logits under the request's grammar mask (a JSON string's next
    character, a forced quote): true of that request, not of free text after the same token.
    Kept apart, free-text requests never draft from them (and grammar-bound requests share
    what they learn with each other). A tuple type, so no salt string can name it.
    """

    salt: str | None


def partition_key(salt: str | None, params: Any) -> Hashable:
    """The persistent-memory partition of a new request: its ``cache_salt``, or the grammar
    partition of that salt when the request asks for structured outputs."""
    if getattr(params, "structured_outputs", None) is not None:
        return GrammarPartition(salt)
    return salt


@dataclass
class RequestRecord:
    """Adapter state of one request.

    Attributes:
        salt: its persistent-memory partition (:func:`partition_key`: vLLM's ``cache_salt``,
            None if unsalted, or that salt's :class:`GrammarPartition`).
        proposal: the full tree proposed for the request's next step; consumed when that
            step is laid out.
        laid: the subtree whose drafts this rank sent, in depth-first order (see
            ``layout.as_scheduled``), consumed with the proposal.
        num_committed: tokens in the drafter's history (0 before the drafter started it).
        seed: prompt rows waiting to be computed, or for the drafter to start the request.
        sampling: what the driver reads from the request's sampling params (see
            :class:`~vllm_recap.vllm.eligibility.SamplingFacts`), for the params it was
            worked out from.
        history: its prompt and output as penalties read them, kept between steps.
        draws: the seeds vLLM draws for it, position by position (seeded sampled requests;
            :mod:`~vllm_recap.vllm.seeded`), None until a step needs them.
    """

    salt: Hashable = None
    proposal: DraftTree | None = None
    laid: DraftTree | None = None
    num_committed: int = 0
    seed: PromptSeed = field(default_factory=PromptSeed)
    sampling: SamplingFacts | None = None
    history: TokenHistory = field(default_factory=TokenHistory)
    draws: SeedStream | None = None


class RequestBook:
    """Request records plus the drafter's lifecycle, driven by vLLM's scheduler output.

    Finished and aborted requests are forgotten; preempted ones keep only their salt (they are
    prefilled again when resumed, and their memories restart then); a new request whose id was
    seen before starts afresh.
    """

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self._records: dict[str, RequestRecord] = {}

    def apply(self, scheduler_output) -> None:
        """Lifecycle of one scheduler step (``finished_req_ids``, preemptions, new requests)."""
        finished = set(scheduler_output.finished_req_ids)
        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", None) or ())
        for req_id in finished:
            self.stop(req_id, keep_salt=False)
        for req_id in (preempted | resumed) - finished:
            self.stop(req_id, keep_salt=True)
        for new in scheduler_output.scheduled_new_reqs:
            self.stop(new.req_id, keep_salt=False)
            self._records[new.req_id] = RequestRecord(salt=partition_key(
                getattr(new, "recap_cache_salt", None), getattr(new, "sampling_params", None)))

    def get(self, req_id: str) -> RequestRecord:
        """The request's record (created empty for a request first seen mid-flight)."""
        record = self._records.get(req_id)
        if record is None:
            record = self._records[req_id] = RequestRecord()
        return record

    def stop(self, req_id: str, keep_salt: bool) -> None:
        """Frees the request's drafter state and record (keeping its salt if asked)."""
        if self.drafter.has_request(req_id):
            self.drafter.stop(req_id)
        old = self._records.pop(req_id, None)
        if keep_salt and old is not None:
            self._records[req_id] = RequestRecord(salt=old.salt)

    def take_proposals(self, req_ids: Iterable[str]
                       ) -> dict[str, tuple[DraftTree, DraftTree | None]]:
        """Pops the proposals (full tree, laid-out subtree sent) of these requests: a proposal
        is valid for one step only."""
        out = {}
        for req_id in req_ids:
            record = self._records.get(req_id)
            if record is not None and record.proposal is not None:
                out[req_id] = (record.proposal, record.laid)
                record.proposal = record.laid = None
        return out

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._records
