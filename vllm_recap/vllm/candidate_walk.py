"""Sampled tree rows decided from each row's largest raw logits, without whole-row processing.

Under Qwen2.5's text settings (T 0.7, top_k 20, top_p 0.8, repetition penalty 1.05) every tree
row went through :func:`~vllm_recap.vllm.tree_sampling.process_tree_logits` and the walk's
softmax and inverse CDF over the whole vocabulary: about ten float32 passes over [N, V]
(measured, bf16 SmolLM2, 2-core AMD EPYC, 26 Spec-Bench prompts x 128: RECAP's work per step
4.8 ms p50 with the adaptive budget, 7.7 ms at a fixed 8 nodes and 12.7 ms at 16, against
~1 ms for greedy trees). For most such rows the result is decided by a few candidates:

- Penalties that only lower logits (repetition >= 1, frequency and presence >= 0) leave every
  entry outside a row's C largest raw logits at or below the C-th raw value ``v_C``, and the
  temperature keeps it at or below ``v_C / T`` (float32 division is monotone).
- vLLM's top-k keeps the entries at or above the k-th largest processed value. When the
  k-th largest processed candidate is above ``v_C / T``, nothing outside the candidates
  survives, and top-p runs over the survivors alone
  (vLLM's rules as :func:`~vllm_recap.vllm.top_k_top_p.filter_sorted` replays them, in one
  compiled call per step: :func:`~vllm_recap.core.candidates.sample_candidates`; exact or
  undecided).
- The node's distribution is then the softmax over the kept candidates, and the draw is
  :func:`~vllm_recap.vllm.tree_walk.sample_rows`'s inverse CDF in token-id order with the
  same uniform draws from the same generators (``tree_walk.row_uniforms``), so the walk
  samples what the whole-row path samples, up to the last bits of float32 sums.

Greedy-equivalent rows in the same step take the argmax of their penalised candidates, decided
when it is above ``v_C`` (:func:`~vllm_recap.vllm.tree_sampling.penalised_top_argmax`'s
rule). A row the candidates do not decide is processed whole, with the same draw.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_recap.core.candidates import descending, memory_rows, sample_candidates
from vllm_recap.core.topk import topk_probs
from vllm_recap.vllm.top_k_top_p import TIE_COLUMNS
from vllm_recap.vllm.tree_sampling import RequestSampling, lowers_only, penalise_candidates
from vllm_recap.vllm.tree_walk import greedy_sample, row_uniforms, sample_rows, seeded_draws
from vllm_recap.vllm.verifier import topk_rows

# Raw logits taken per row. A top_k up to CANDIDATES - TIE_COLUMNS is served (Qwen2.5's 20,
# and the usual 40 or 50); the margin leaves room for candidates the penalties push down.
CANDIDATES = 64


def from_candidates(rs: RequestSampling) -> bool:
    """Its tree rows may be decided from the candidates: greedy-equivalent, or sampled with
    top-k (up to ``CANDIDATES - TIE_COLUMNS``) and no min-p, penalties of the lowering kind."""
    if not lowers_only(rs):
        return False
    return rs.greedy_equivalent or (0 < rs.top_k <= CANDIDATES - TIE_COLUMNS
                                    and rs.min_p == 0.0)


@dataclass
class CandidateRows:
    """The outcome for M node rows.

    Attributes:
        target: [M] int64, the argmax (greedy-equivalent rows) or the draw (sampled rows);
            -1 for a row the candidates did not decide and :meth:`resolve` has not processed.
        memory_ids: [M, K] int64, each row's top K by processed value, largest first (for a
            row not resolved, as far as its candidates show it).
        memory_probs: [M, K] float32, the softmax over those K processed values (0 for
            masked entries).
        whole_rows: how many rows were processed whole.
        pending: rows the candidates did not decide, not processed yet, and rows of requests
            with position seeds not drawn yet (a draw costs a pass over the vocabulary).
    """

    target: np.ndarray
    memory_ids: np.ndarray
    memory_probs: np.ndarray
    whole_rows: int = 0
    pending: set[int] = field(default_factory=set)
    _resolve: Callable[[int], bool] | None = field(default=None, repr=False)

    def resolve(self, r: int) -> int:
        """Decides pending row ``r``: processed whole (its target and memory row become the
        whole-row path's), or a seeded row's draw over its kept candidates; returns its
        target."""
        if r in self.pending:
            self.pending.discard(r)
            self.whole_rows += int(self._resolve(r))
        return int(self.target[r])


def walk_rows(values: np.ndarray, ids: np.ndarray, owner: np.ndarray,
              paths: Sequence[Sequence[int]], requests: Sequence[RequestSampling],
              memory_k: int, whole: Callable[[int], torch.Tensor]) -> CandidateRows:
    """Each node row's target and memory row, from its candidates where they decide it.

    Args:
        values: [M, C] float32 raw logits of each row's C largest, descending.
        ids: [M, C] int64 their token ids.
        owner: [M] index into ``requests`` of each row's request, rows of one request in
            ascending node order (the order ``tree_walk.row_uniforms`` draws them in).
        paths: per row, the tokens on its node's path (root excluded, node included).
        requests: the requests (each :func:`from_candidates`); greedy-equivalent ones with
            their temperature already dropped (``tree_verify._request_states``).
        memory_k: K of the memory rows (<= C).
        whole: row index -> that row's raw logits [V]: rows the candidates do not decide
            (about 4% under Qwen2.5's text settings in bf16, mostly equal logits across the
            top-p cut, which vLLM's unstable sort decides) are processed whole, as
            ``process_tree_logits`` and ``verify_trees`` would, with the same uniform draw --
            when asked (:meth:`CandidateRows.resolve`): a walk reaches few of a tree's rows,
            and one whole row costs a sort of the vocabulary (~2.6 ms for 49k on the 2-core
            CPU). Every row's uniform is drawn here, so a row resolved late draws what it
            would have drawn at once.
    """
    processed = penalise_candidates(values, ids, owner, paths, requests)
    rest = values[:, -1]
    greedy = np.array([requests[g].is_greedy for g in owner.tolist()], bool)
    target = np.zeros(len(values), np.int64)
    undecided = np.zeros(len(values), bool)
    sampled = np.flatnonzero(~greedy)
    uniforms = None
    if len(sampled):
        ordered, cand = descending(processed[sampled], ids[sampled])
        uniforms = row_uniforms(owner[sampled], requests)
        vals, drawn, exact = _sampled(ordered, cand, rest[sampled], owner[sampled], requests,
                                      uniforms)
        processed[sampled], ids = vals, ids.copy()
        ids[sampled] = cand
        target[sampled[exact]] = drawn[exact]
        undecided[sampled[~exact]] = True
    # Rows of requests with position seeds take vLLM's own draw at their seed (``seeded``),
    # when a walk reaches them: over the kept candidates where they decided the row, else
    # over the whole row.
    seed_of = np.full(len(values), -1, np.int64)
    if any(requests[g].position_seeds is not None for g in set(owner.tolist())):
        seed_of[:] = [_seed(requests[g], len(p)) for g, p in zip(owner.tolist(), paths)]
    seeded = (seed_of >= 0) & ~greedy
    kept = seeded & ~undecided
    undecided |= seeded
    # The memory rows as ``topk_rows`` takes them from whole processed rows, compiled (with
    # the sampled rows' order above: numpy sorts, gathers and a Python pass over masked rows
    # took 52 us warm for 9 rows of 64 against 16, and ~0.05 ms of a Qwen2.5-text tree step's
    # acceptance). Only sampled rows have masked entries, so a greedy row's ids below are its
    # candidates' own.
    mem_vals, mem_ids = memory_rows(processed, ids, memory_k)
    if greedy.any():
        top = mem_vals[greedy]
        tie = top == top[:, :1]
        target[greedy] = np.where(tie, mem_ids[greedy], np.iinfo(np.int64).max).min(axis=1)
        # decided: the best (and the K-th, for the memory row) above every entry outside
        undecided[greedy] = ~((top[:, 0] > rest[greedy]) & (top[:, -1] > rest[greedy]))
    # the compiled softmax topk_rows uses, on the same K float32 values in the same order
    _, probs = topk_probs(np.ascontiguousarray(mem_vals).view(np.int32), memory_k, False)
    at = {int(r): i for i, r in enumerate(sampled.tolist())}
    p_set = any(requests[g].top_p < 1 for g in owner[sampled].tolist())

    masked: list[torch.Tensor] = []  # one [1, V] row of -inf, allocated once a step

    def resolve(r: int) -> bool:
        if kept[r]:  # vLLM's row: the kept candidates' values, -inf elsewhere
            if not masked:
                masked.append(torch.full((1, whole(r).shape[-1]), -math.inf))
            cols = torch.from_numpy(ids[r])
            masked[0][0, cols] = torch.from_numpy(processed[r])
            target[r] = int(seeded_draws(masked[0], seed_of[r:r + 1])[0])
            masked[0][0, cols] = -math.inf
            return False
        row = _whole_row(whole(r), requests[owner[r]], paths[r], p_set)
        if greedy[r]:
            target[r] = int(greedy_sample(row)[0])
        elif seeded[r]:
            target[r] = int(seeded_draws(row, seed_of[r:r + 1])[0])
        else:
            target[r] = int(sample_rows(torch.softmax(row, dim=-1),
                                        uniforms=uniforms[at[r]:at[r] + 1])[0])
        mem_ids[r], probs[r] = (a[0] for a in topk_rows(row, memory_k))
        return True

    pending = np.flatnonzero(undecided).tolist()
    target[pending] = -1
    return CandidateRows(target, mem_ids, probs, pending=set(pending), _resolve=resolve)


def _seed(rs: RequestSampling, depth: int) -> int:
    """The request's position seed at ``depth``, -1 without position seeds."""
    return -1 if rs.position_seeds is None else int(rs.position_seeds[depth])


def _whole_row(logits: torch.Tensor, rs: RequestSampling, path: Sequence[int],
               p_set: bool) -> torch.Tensor:
    """[1, V] float32: one row processed whole, as ``process_tree_logits`` does (penalised;
    sampled rows also divided by the temperature and filtered by vLLM's own top-k/top-p,
    with a top-p tensor when the step has one: ``p_set``). Such a row is one the candidates
    did not decide, which vLLM's function would sort (~4 ms for 49k on the 2-core CPU)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    row = logits.float().reshape(1, -1).clone()
    vocab = row.shape[1]
    if rs.has_penalties:  # only the entries some token names change (apply_penalties_sparse)
        seen = np.unique(np.concatenate([np.asarray(rs.prompt_token_ids, np.int64),
                                         np.asarray(rs.output_token_ids, np.int64),
                                         np.asarray(path, np.int64)]))
        seen = seen[(seen >= 0) & (seen < vocab)][None]
        at = torch.from_numpy(seen[0])
        row[0, at] = torch.from_numpy(penalise_candidates(
            row[:, at].numpy(), seen, np.zeros(1, np.int64), [path], [rs])[0])
    if rs.is_greedy:
        return row
    row.div_(rs.temperature)  # apply_temperature's float32 division
    k = torch.tensor([rs.top_k if 0 < rs.top_k < vocab else vocab], dtype=torch.int32)
    p = torch.tensor([rs.top_p], dtype=torch.float32) if p_set else None
    return apply_top_k_top_p(row, k, p)


def _sampled(vals: np.ndarray, ids: np.ndarray, rest: np.ndarray, owner: np.ndarray,
             requests: Sequence[RequestSampling], uniforms: torch.Tensor
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Temperature, top-k/top-p and one draw for the sampled rows
    (:func:`vllm_recap.core.candidates.sample_candidates`, one compiled call).

    Args:
        vals: [S, C] float32 penalised candidates, descending; ids: [S, C] their ids.
        rest: [S] float32 raw C-th value (every entry outside is at or below it, penalised).
        owner: [S] request index of each row; requests: see :func:`walk_rows`.
        uniforms: [S, 1] each row's uniform draw (:func:`~vllm_recap.vllm.tree_walk.row_uniforms`).

    Returns:
        [S, C] float32 processed candidates (masked ones -inf), the drawn token [S] int64,
        and exact [S] bool (rows decided here; elsewhere both mean nothing).
    """
    rs = [requests[g] for g in owner.tolist()]
    top_p = [r.top_p for r in rs]
    return sample_candidates(
        vals, ids, rest, np.array([r.temperature for r in rs], np.float32),
        np.array([r.top_k for r in rs], np.int64),
        np.array(top_p, np.float32) if any(q < 1 for q in top_p) else None,
        uniforms.numpy().reshape(-1))
