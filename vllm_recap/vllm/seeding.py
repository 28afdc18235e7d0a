"""Prompt seeding: top-K rows at prompt positions, so memories know the prompt from step one.

vLLM computes logits only for the last prompt position. The prompt's other positions are
where an answer that quotes its input gets its drafts, so at each prefill chunk RECAP runs
the LM head over the hidden states of the first occurrence of every distinct prompt token
(at most ``prompt_seed_rows`` per request) and hands those rows to the drafter when the
request starts decoding. Selection is vectorised per chunk (``np.unique``), no per-token loop.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_recap.vllm.context import StepPlan
from vllm_recap.vllm.records import RequestBook
from vllm_recap.vllm.verifier import topk_rows


class PromptSeeder:
    """Chooses prompt positions per prefill chunk and computes their rows.

    Args:
        max_rows: most rows per request (``prompt_seed_rows``; 0 = off).
        top_k: K of a row.
        blocked: [V] bool, tokens never seeded (image/video placeholders).
        max_rows_per_step: most rows per engine step over all requests: each row is an
            LM-head row (tens of microseconds to a millisecond), and a burst of arrivals must
            not stall one step for all running requests.
    """

    def __init__(self, max_rows: int, top_k: int, blocked: np.ndarray,
                 max_rows_per_step: int = 128) -> None:
        self.max_rows = max_rows
        self.top_k = top_k
        self.blocked = blocked
        self.max_rows_per_step = max_rows_per_step
        self.rows_seeded = 0

    def choose(self, plan: StepPlan, token_ids: np.ndarray, records: RequestBook
               ) -> list[tuple[int, np.ndarray]]:
        """Positions to seed in this step's prefill chunks.

        Args:
            plan: the step layout (num_computed, num_scheduled, num_prompt).
            token_ids: [B, max_len] vLLM's token id buffer (``input_batch.token_ids_cpu``).
            records: the request records (their seeds' ``seen`` sets are updated).

        Returns:
            (batch index, [m] prompt positions) per request with something to seed.
        """
        if self.max_rows <= 0:
            return []
        picks = []
        step_room = self.max_rows_per_step
        for i, req_id in enumerate(plan.req_ids):
            start, n_prompt = int(plan.num_computed[i]), int(plan.num_prompt[i])
            if start >= n_prompt or step_room <= 0:
                continue
            seed = records.get(req_id).seed
            room = min(self.max_rows - seed.num_rows, step_room)
            if room <= 0:
                continue
            end = min(n_prompt, start + int(plan.num_scheduled[i]))
            tokens, first = np.unique(token_ids[i, start:end].astype(np.int64),
                                      return_index=True)
            fresh = ~np.isin(tokens, seed.seen, assume_unique=True) & ~self.blocked[tokens]
            order = np.argsort(first[fresh], kind="stable")[:room]
            if order.size == 0:
                continue
            chosen = tokens[fresh][order]
            seed.seen = np.union1d(seed.seen, chosen)
            seed.num_rows += int(order.size)
            step_room -= int(order.size)
            picks.append((i, start + first[fresh][order]))
        return picks

    def seed(self, plan: StepPlan, picks: list[tuple[int, np.ndarray]],
             hidden_states: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
             records: RequestBook) -> None:
        """Runs the LM head over the chosen positions' hidden states; stores the rows.

        Args:
            plan: the step layout (query starts, num_computed).
            picks: from :meth:`choose`.
            hidden_states: [T, hidden] the step's last hidden states (flat token batch).
            compute_logits: the target model's ``compute_logits``.
            records: where the rows wait for the drafter.
        """
        if not picks:
            return
        flat = np.concatenate([plan.query_starts[i] + pos - plan.num_computed[i]
                               for i, pos in picks])
        logits = compute_logits(hidden_states[torch.from_numpy(flat).to(hidden_states.device)])
        ids, probs = topk_rows(logits, self.top_k)
        offset = 0
        for i, positions in picks:
            m = positions.shape[0]
            records.get(plan.req_ids[i]).seed.add(positions, ids[offset:offset + m],
                                                  probs[offset:offset + m])
            offset += m
        self.rows_seeded += offset
