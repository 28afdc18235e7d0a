"""Prompt seeding: top-K rows at prompt positions, so memories know the prompt from step one.

vLLM computes logits only for the last prompt position. The prompt's other positions are
where an answer that quotes its input gets its drafts, so in each prefill chunk RECAP takes
the first occurrence of every distinct prompt token (at most ``prompt_seed_rows`` per request;
selection vectorised per chunk with ``np.unique``) and needs the LM head over those
positions' last hidden states.

On a CPU the LM head costs mostly the reading of its weights, not the rows: a separate
LM-head call over 128 rows was a 9 ms step for SmolLM2 (49k x 576) and 35 ms for Gemma-3-270M
(262k x 640) -- the proposer's p99 -- and a burst of arrivals stalled every running request's
step for it. So the rows ride along with the LM-head call the step makes anyway: the driver
chooses the positions when the step is laid out (:meth:`PromptSeeder.plan`), a forward hook
keeps the step's hidden states, and :meth:`PromptSeeder.fused_inputs` appends the chosen
rows to the step's own ``compute_logits`` input. Where that call cannot carry them (CUDA
graphs run no Python hooks; a call of an unexpected shape), :meth:`PromptSeeder.finish`
computes them with a call of their own. At most ``max_rows_per_step`` rows are computed per
step over the batch (on a CPU a multiply-add budget, :func:`rows_per_step`), shared out among
the step's decoding requests (:meth:`PromptSeeder.rows_this_step`); the others wait,
as copies of their hidden states, for the next steps. On a CPU with one tensor-parallel rank
the bound also keeps a step's rows within ``SEED_SECONDS_PER_STEP`` by their measured cost:
what they add to the step's own LM-head call (by the call's measured cost per row count,
:meth:`~vllm_recap.vllm.clock.LmHeadTimes.growth`) plus their own work per row (top-K,
processing); with several ranks it depends on the model only, so every rank seeds the same
rows. Rows reach the drafter when the request starts decoding, or at once if it already has.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vllm_recap.vllm.clock import LmHeadTimes
from vllm_recap.vllm.context import StepPlan
from vllm_recap.vllm.memory_rows import process_rows
from vllm_recap.vllm.records import RequestBook
from vllm_recap.vllm.tree_sampling import RequestSampling
from vllm_recap.vllm.verifier import topk_rows

# LM-head multiply-adds per step for prompt rows on a CPU (compute only: the weights are read
# for the step's own rows anyway). SmolLM2 (49k x 576) gets the cap of 128 rows, Gemma-3-270M
# (262k x 640) 23. Not the ~2-3 ms once assumed: on the 2-core AMD EPYC in bfloat16 a torch
# linear of SmolLM2's LM head takes 5.8 ms for 1 row and 23.6 ms for 128, and 13 Spec-Bench
# prompts (2,246 tokens) prefilled in 2.97 s with seeding against 2.62 s without (~28 ms per
# prompt, measured ad hoc, 2026-12-03); seeding bought 1.957 against 1.920 tokens per pass
# (fixed 8 nodes, 26 prompts x 128), roughly what it costs at 128 new tokens. The bound keeps
# one step's stall near a decode step's length. `benchmarks.methods`' abl-seed measures it at a
# fixed budget, recap-tree-seed under the adaptive default (at concurrency 4, 9 interleaved
# rounds: no visible difference, 2026-12-03). Beside the continuations and the shared index the
# rows took 0-0.7% of the passes off greedy Spec-Bench runs (2026-12-07), so a CPU engine no
# longer seeds by default (``options.DEVICE_DEFAULTS``); this module serves those that ask.
CPU_SEED_MACS_PER_STEP = 4e9
# The fewest rows a decoding request's share of a step's bound is cut to (``rows_this_step``).
MIN_ROWS_PER_STEP = 8
MAX_ROWS_PER_STEP = 128
# ... and, where the engine runs on one CPU rank, a time bound measured as it runs: a row costs
# what it adds to the step's LM-head call, plus its logits (V floats written and read) and a
# top-K over them -- on the Intel Xeon (bf16) ~0.02 ms for SmolLM2 but 0.2-0.35 ms for
# Gemma-3-270M (262k vocabulary), whose 23 rows a step (the multiply-add budget) made 5-10 ms
# steps; and ~0.07 ms for SmolLM2 in float32, whose 128 rows made 9-11 ms steps. Those steps
# were all of the proposer's p99 at batch 1 (SmolLM2 bf16 4.3 ms, 2.3 without seeding; float32
# 10.8 / 2.7; Gemma-3-270M 12.8 / 3.7; 13 Spec-Bench prompts x 128,
# `benchmarks.proposer_profile`, 2026-12-06). A bound by an average cost per row, floored at 8
# rows, still left Gemma-3-270M's p99 at 7.4-8.0 ms, every p99 step a seeding one: its LM head
# is a staircase in the call's rows (~14 ms flat to 11 rows, then steps of 0.7-1.8 ms), so 8
# rows cost ~0.2 ms in a 1-row step and ~2-3 ms in a step verifying a 12-node tree. The bound
# now prices each step's rows by that staircase as measured (`LmHeadTimes.growth`), and its
# floor is 1 row (so prices go on being measured): under the average-per-row bound a floor of
# 1 had raised Gemma-3-270M's p99 from 6.2-6.3 to 6.8-7.5 ms, the jumps of the staircase
# being paid by more steps (`benchmarks/results/gemma-seed-floor-xeon_2026-12-06/`); priced,
# a jump is paid only where it fits.
SEED_SECONDS_PER_STEP = 2e-3
ROW_SECONDS_WEIGHT = 0.25  # of each seeding step's seconds per row in the moving estimate


def rows_per_step(vocab: int, hidden: int, on_cpu: bool) -> int:
    """Most prompt rows computed per engine step: 128 on an accelerator (where the LM head
    over them costs next to nothing), a multiply-add budget on a CPU."""
    if not on_cpu:
        return MAX_ROWS_PER_STEP
    rows = int(CPU_SEED_MACS_PER_STEP // max(1, vocab * hidden))
    return max(MIN_ROWS_PER_STEP, min(MAX_ROWS_PER_STEP, rows))


def seconds_per_step(on_cpu: bool, tensor_parallel: int) -> float | None:
    """The time bound of a step's prompt rows (see ``SEED_SECONDS_PER_STEP``): on one CPU
    rank only, None otherwise -- tensor-parallel ranks must seed the same rows (a measured
    bound differs from rank to rank), and a device's host-side timing does not see its
    kernels (the LM head over rows costs next to nothing there)."""
    return SEED_SECONDS_PER_STEP if on_cpu and tensor_parallel == 1 else None


@dataclass
class SeedStep:
    """The prompt rows of one engine step.

    Attributes:
        picks: (batch index, [m] prompt positions) chosen in this step's prefill chunks.
        now: how many of the picked positions (in pick order) are computed in this step.
        waiting: (request id, [m] positions, [m, hidden] hidden states) chosen in earlier
            steps and computed in this one.
        hidden: [T, hidden] this step's last hidden states (from the forward hook).
        logits: [rows, V] the rows' logits (waiting first, then picked), once computed.
        head_seconds: the LM-head part of the step's seeding seconds (the rows' share of the
            step's own call, or a call of their own).
    """

    picks: list[tuple[int, np.ndarray]]
    now: int
    waiting: list[tuple[str, np.ndarray, torch.Tensor]]
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    head_seconds: float = 0.0

    @property
    def num_rows(self) -> int:
        """Rows computed in this step."""
        return self.now + sum(len(p) for _, p, _ in self.waiting)


class PromptSeeder:
    """Chooses prompt positions per prefill chunk and computes their rows, a bounded number
    per step, in the step's own LM-head call where it can.

    Args:
        max_rows: most rows per request (``prompt_seed_rows``; 0 = off).
        top_k: K of a row.
        blocked: [V] bool, tokens never seeded (image/video placeholders).
        max_rows_per_step: most rows computed per engine step over all requests (see
            :func:`rows_per_step`); chosen rows beyond it wait for the next steps.
        seconds_per_step: also keep a step's rows within this many seconds (see
            :meth:`step_bound`); None: the row bound alone (where and why:
            :func:`seconds_per_step`).
        lm_head: the target's LM-head calls' measured seconds by row count (the driver's),
            which price the rows a step's call carries; None: rows priced by their own work
            alone.
    """

    def __init__(self, max_rows: int, top_k: int, blocked: np.ndarray,
                 max_rows_per_step: int = MAX_ROWS_PER_STEP,
                 seconds_per_step: float | None = None,
                 lm_head: LmHeadTimes | None = None) -> None:
        self.max_rows = max_rows
        self.top_k = top_k
        self.blocked = blocked
        self.max_rows_per_step = max_rows_per_step
        self.seconds_per_step = seconds_per_step
        self.lm_head = lm_head
        # moving seconds per row of seeding steps, their LM-head part left out
        self.row_seconds: float | None = None
        self.rows_seeded = 0
        self.fused_rows = 0  # rows that rode along with a step's own LM-head call

    def observe(self, rows: int, seconds: float, head_seconds: float = 0.0) -> None:
        """A step computed ``rows`` prompt rows in ``seconds`` (its seeding time, all of it),
        ``head_seconds`` of them in the LM head (priced apart: :meth:`step_bound`)."""
        if rows <= 0:
            return
        per_row = max(0.0, seconds - head_seconds) / rows
        old = self.row_seconds
        self.row_seconds = per_row if old is None else old + ROW_SECONDS_WEIGHT * (per_row - old)

    def step_bound(self, own_rows: int) -> int:
        """Most rows this step over the batch, whose own LM-head call has ``own_rows`` rows:
        ``max_rows_per_step``, and where a time bound is set and rows were measured, the most
        rows r whose measured price -- what r more rows add to the call
        (:meth:`~vllm_recap.vllm.clock.LmHeadTimes.growth`) plus r times their own work per
        row -- is within ``seconds_per_step``; at least 1, so the prices go on being measured.
        """
        if self.seconds_per_step is None or self.row_seconds is None:
            return self.max_rows_per_step
        rows = np.arange(self.max_rows_per_step + 1)
        price = rows * self.row_seconds
        growth = self.lm_head.growth(own_rows, rows) if self.lm_head is not None else None
        if growth is not None:
            price = price + growth
        fit = np.flatnonzero(price <= self.seconds_per_step)
        return max(1, int(fit[-1]) if fit.size else 0)

    def plan(self, plan: StepPlan, token_ids: np.ndarray, records: RequestBook
             ) -> SeedStep | None:
        """This step's rows: positions chosen in its prefill chunks plus rows waiting from
        earlier steps (batch order, oldest first); at most ``max_rows_per_step`` are computed
        now, waiting ones first. None when there is nothing to seed."""
        picks = self.choose(plan, token_ids, records)
        if not picks and not any(records.get(r).seed.pending
                                 for r in plan.req_ids if r in records):
            return None
        room = self.rows_this_step(plan)
        waiting = []
        for req_id in plan.req_ids:
            seed = records.get(req_id).seed if req_id in records else None
            while seed is not None and seed.pending and room > 0:
                positions, rows = seed.pending[0]
                if len(positions) > room:  # split: the rest waits for the next step
                    seed.pending[0] = (positions[room:], rows[room:])
                    positions, rows = positions[:room], rows[:room]
                else:
                    seed.pending.pop(0)
                waiting.append((req_id, positions, rows))
                room -= len(positions)
        if not picks and not waiting:
            return None
        return SeedStep(picks, min(room, sum(len(p) for _, p in picks)), waiting)

    def rows_this_step(self, plan: StepPlan) -> int:
        """:meth:`step_bound` divided among the step's decoding requests (at least
        ``MIN_ROWS_PER_STEP``, never above the bound): a seeding step stalls every one of
        them, while its rows serve one request's drafts. At concurrency 16 (bf16 SmolLM2,
        2-core EPYC) the steps that seeded 128 rows ran 33-55 ms against 22-25 ms without (the
        steps right after a burst of arrivals), for drafts that under load pay little (see
        the comment above)."""
        bound = self.step_bound(int(plan.logits_starts[-1]))
        decoding = int(np.count_nonzero(plan.num_computed >= plan.num_prompt))
        share = bound // max(1, decoding)
        return min(bound, max(MIN_ROWS_PER_STEP, share))

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
        for i, req_id in enumerate(plan.req_ids):
            start, n_prompt = int(plan.num_computed[i]), int(plan.num_prompt[i])
            if start >= n_prompt:
                continue
            seed = records.get(req_id).seed
            room = self.max_rows - seed.num_rows
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
            picks.append((i, start + first[fresh][order]))
        return picks

    @staticmethod
    def _picked_hidden(step: SeedStep, plan: StepPlan, hidden_states: torch.Tensor,
                       first: int, last: int | None) -> list[torch.Tensor]:
        """Hidden states (copies) of picked positions ``first:last`` in pick order."""
        if not step.picks:
            return []
        flat = np.concatenate([plan.query_starts[i] + pos - plan.num_computed[i]
                               for i, pos in step.picks])[first:last]
        if flat.size == 0:
            return []
        return [hidden_states[torch.from_numpy(flat).to(hidden_states.device)]]

    def fused_inputs(self, step: SeedStep, plan: StepPlan) -> torch.Tensor | None:
        """[rows, hidden] the hidden states to append to the step's own LM-head input: the
        waiting rows, then the picked ones computed now. None if the forward hook did not
        capture this step's hidden states (the rows then get a call of their own)."""
        if step.now and (step.hidden is None
                         or step.hidden.shape[0] < int(plan.query_starts[-1])):
            return None
        parts = [rows for _, _, rows in step.waiting]
        parts += self._picked_hidden(step, plan, step.hidden, 0, step.now) if step.now else []
        return torch.cat(parts) if parts else None

    def finish(self, step: SeedStep, plan: StepPlan, hidden_states: torch.Tensor,
               compute_logits: Callable[[torch.Tensor], torch.Tensor],
               records: RequestBook,
               states: Callable[[str], RequestSampling | None] | None = None) -> None:
        """After the step: keeps the picked rows beyond this step's bound for later, computes
        this step's rows if the fused call did not, and delivers them.

        Args:
            step: from :meth:`plan` (its ``logits`` set if the rows rode along).
            plan: the step layout (query starts, num_computed).
            hidden_states: [T, hidden] the step's last hidden states (flat token batch).
            compute_logits: the target model's own ``compute_logits``.
            records: the request records (waiting rows; the drafter, for started requests).
            states: request id -> its memory rows' sampling state
                (:func:`~vllm_recap.vllm.memory_rows.memory_state` of its prompt alone: at
                decode time every prompt token is penalised), None for raw rows.
        """
        later = self._picked_hidden(step, plan, hidden_states, step.now, None)
        if later:
            self._stash_later(step, plan, later[0], records)
        if step.num_rows == 0:
            return
        logits = step.logits
        if logits is None:
            hidden = torch.cat([rows for _, _, rows in step.waiting]
                               + self._picked_hidden(step, plan, hidden_states, 0, step.now))
            t0 = time.perf_counter()
            logits = compute_logits(hidden)
            step.head_seconds += time.perf_counter() - t0
        else:
            self.fused_rows += step.num_rows
        ids, probs = topk_rows(logits, self.top_k)
        destinations = [(req_id, positions) for req_id, positions, _ in step.waiting]
        destinations += self._split_picks(step, plan, 0, step.now)
        offset = 0
        for req_id, positions in destinations:
            m = len(positions)
            state = states(req_id) if states is not None else None
            if state is not None:
                process_rows(logits, np.arange(offset, offset + m), ids, probs, state,
                             [()] * m)
            part = (ids[offset:offset + m], probs[offset:offset + m], positions)
            if records.drafter.has_request(req_id):  # decoding already: straight in
                records.drafter.add_prompt_rows(req_id, part)
            elif req_id in records:
                records.get(req_id).seed.add(positions, part[0], part[1])
            offset += m
        self.rows_seeded += offset

    @staticmethod
    def _split_picks(step: SeedStep, plan: StepPlan, first: int, last: int | None
                     ) -> list[tuple[str, np.ndarray]]:
        """(request id, positions) of picked positions ``first:last`` (pick order)."""
        out, offset = [], 0
        for i, positions in step.picks:
            m = len(positions)
            lo = max(first - offset, 0)
            hi = m if last is None else min(last - offset, m)
            if hi > lo:
                out.append((plan.req_ids[i], positions[lo:hi]))
            offset += m
        return out

    def _stash_later(self, step: SeedStep, plan: StepPlan, rows: torch.Tensor,
                     records: RequestBook) -> None:
        """Picked rows beyond this step's bound wait in their records (hidden-state copies)."""
        offset = 0
        for req_id, positions in self._split_picks(step, plan, step.now, None):
            m = len(positions)
            if req_id in records:
                records.get(req_id).seed.pending.append((positions, rows[offset:offset + m]))
            offset += m
