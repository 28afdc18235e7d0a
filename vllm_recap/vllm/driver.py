"""The step driver: one engine step of RECAP, read top to bottom.

    on_update_states  lifecycle: free finished / aborted / preempted requests, record new ones
    begin_step        layout (which drafts are trees) -> node positions -> install the context
    (forward)         attention backends read the context: tree masks, node K/V kept
    sample            top-K rows + tree acceptance (in vLLM's layout) + KV compaction
    propose           prompt rows -> observe + commit per request -> budget -> next drafts
    end_step          clear the context (also when anything above raised)

The driver implements :class:`~vllm_recap.vllm.hooks.RecapHooks`, the interface the runner
seams call. It owns the step's :class:`~vllm_recap.vllm.context.StepContext` (installed in its
:class:`~vllm_recap.vllm.context.StepScope` for exactly one step) and the request records;
the engine-free algorithm lives in the :class:`~vllm_recap.core.drafter.Drafter`.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from vllm_recap.core.budget import BudgetController, Decision
from vllm_recap.core.config import BudgetPolicy, RecapConfig
from vllm_recap.core.drafter import Drafter
from vllm_recap.core.tree import DraftTree
from vllm_recap.patches.runner import verify_runner
from vllm_recap.vllm.clock import LmHeadTimes, StepClock
from vllm_recap.vllm.context import StepContext, StepRows, StepScope
from vllm_recap.vllm.drain import DrainWatch, longest_requests, remaining_tokens
from vllm_recap.vllm.eligibility import SamplingFacts, surely_finished
from vllm_recap.vllm.idle import WATCH_MATCH, IdleMode
from vllm_recap.vllm.layout import (as_scheduled, build_plan, next_prefill_tokens,
                                    rewrite_positions, slots_with_chains, whole_step_slots)
from vllm_recap.vllm.memory_rows import memory_state, process_rows
from vllm_recap.vllm.metrics import TreeMetrics, log_idle
from vllm_recap.vllm.records import RequestBook
from vllm_recap.vllm.seeded import SeedDraws, SeedStream
from vllm_recap.vllm.seeding import MAX_ROWS_PER_STEP, PromptSeeder
from vllm_recap.vllm.token_history import TokenHistory
from vllm_recap.vllm.tree_sampling import RequestSampling
from vllm_recap.vllm.tree_verify import tree_output
from vllm_recap.vllm.tree_verify import prepare as prepare_trees
from vllm_recap.vllm.tree_verify import write as write_trees
from vllm_recap.vllm.verifier import (compact_kv, node_tokens_of_rows, off_chain,
                                      top1_is_argmax, topk_rows)

# DEBUG: every budget decision (``VLLM_LOGGING_LEVEL=DEBUG``; idle-mode switches: idle.py)
logger = logging.getLogger("vllm.recap")

# What the driver reads from vLLM's model runner (checked once, at the first step).
RUNNER_ATTRIBUTES = (
    "input_batch.req_ids", "input_batch.num_reqs", "input_batch.num_computed_tokens_cpu",
    "input_batch.num_prompt_tokens", "input_batch.num_tokens_no_spec",
    "input_batch.generators", "input_batch.req_id_to_index", "discard_request_mask.np",
    "input_batch.token_ids_cpu", "query_start_loc.np", "positions", "input_ids.np",
    "requests", "uses_mrope", "model_config.logprobs_mode",
)


# Steps of at most this many tokens stash tree K/V as views in an eager model (a view keeps
# its layer's QKV output alive until acceptance: for a 7B model ~9 KB per token and layer).
KV_VIEWS_UP_TO = 512
def without_empty_drafts(spec_decode_metadata):
    """The metadata to sample a step with: None (vLLM's plain sampler) when no request has a
    draft token.

    With a speculative config vLLM sends every step through its rejection sampler, drafts or
    not, and that sampler draws exponential noise over the whole vocabulary for every request
    (``sample_recovered_tokens``) whenever some request samples -- Qwen2.5-VL's recommended
    settings included (temperature 0.1). With no draft token that noise is never read: the
    step's tokens are the bonus tokens, sampled by the same ``Sampler`` that the plain path
    calls (the spec-token list it would merge into the penalties is empty), and for seeded
    requests the rejection sampler skips their generators when they have no drafts. At
    concurrency 4 (bf16 SmolLM2) it cost 2.8 ms of a 26.5 ms idle step."""
    if spec_decode_metadata is None or sum(spec_decode_metadata.num_draft_tokens):
        return spec_decode_metadata
    return None


def decode_context(plan) -> float:
    """Mean context length (tokens in the KV cache) of the step's decoding requests, the
    second key of the budget's cost model; 0 in a step of prefill chunks only."""
    computed = [c for c, p in zip(plan.num_computed.tolist(), plan.num_prompt.tolist())
                if c >= p]  # plain Python: see node_tokens_of_rows
    return sum(computed) / len(computed) if computed else 0.0


@dataclass(frozen=True)
class DriverSettings:
    """Per-engine facts the driver needs besides the RECAP config.

    Attributes:
        num_spec_tokens: most draft tokens per request and step (vLLM's setting).
        max_model_len: the model's length limit (no draft may cross it).
        blocked: [V] bool, tokens never drafted or seeded (image/video placeholders).
        tree_mode: verify trees if the engine can (False: every request gets its best path as
            a chain).
        seed_rows_per_step: most prompt rows computed per step (see
            :func:`~vllm_recap.vllm.seeding.rows_per_step`).
        seed_seconds_per_step: also keep a step's prompt rows within this many seconds, by
            their measured cost (None: the row bound alone; see
            :class:`~vllm_recap.vllm.seeding.PromptSeeder`).
        eager: the model runs without a compiled graph (tree K/V may be stashed as views:
            ``StepContext.kv_views``).
    """

    num_spec_tokens: int
    max_model_len: int
    blocked: np.ndarray
    tree_mode: bool
    seed_rows_per_step: int = MAX_ROWS_PER_STEP
    seed_seconds_per_step: float | None = None
    eager: bool = False


def _clears_context(hook: Callable) -> Callable:
    """A hook that raises leaves no step context behind."""

    @functools.wraps(hook)
    def run(self: StepDriver, *args, **kwargs):
        try:
            return hook(self, *args, **kwargs)
        except BaseException:
            self.scope.clear()
            raise

    return run


class StepDriver:
    """Sequences RECAP's hooks for one engine step (one driver per worker).

    Args:
        config: RECAP's knobs.
        drafter: the engine-free drafter (memories, trees).
        settings: engine facts.
    """

    def __init__(self, config: RecapConfig, drafter: Drafter, settings: DriverSettings) -> None:
        self.config = config
        self.drafter = drafter
        self.settings = settings
        # Trees, or single paths for every request; the proposer switches trees off at model
        # load when a layer cannot verify them (before the first step).
        self.tree_mode = settings.tree_mode
        self.scope = StepScope()
        self.records = RequestBook(drafter)
        self.clock = StepClock()
        self.lm_head = LmHeadTimes()
        self.seeder = PromptSeeder(config.prompt_seed_rows, config.top_k, settings.blocked,
                                   settings.seed_rows_per_step, settings.seed_seconds_per_step,
                                   self.lm_head)
        self.budget = BudgetController(settings.num_spec_tokens, config.depth_discounts)
        self.adaptive = config.budget_policy is BudgetPolicy.ADAPTIVE
        self.metrics = TreeMetrics()
        self.seed_draws = SeedDraws()
        self.stats = {"steps": 0, "idle_steps": 0, "tree_requests": 0, "off_chain_accepts": 0,
                      "kv_compactions": 0, "resynced": 0, "whole_steps": 0,
                      # steps proposing while the batch drains, and their decoding requests
                      # in all and those the run waited for (the only ones proposed)
                      "drain_steps": 0, "drain_decoding": 0, "drain_longest": 0,
                      # idle steps that scheduled drafts from the continuation watch
                      "watched_steps": 0}
        self.drain = DrainWatch()
        self.idle_mode = IdleMode(self.adaptive, self.drain)
        # The budget's decision for the drafts the next step verifies, and (decision, drafts
        # accepted) of the step that verified them, until the clock knows that step's seconds.
        self._decision: Decision | None = None
        self._outcome: tuple[Decision, int] | None = None
        self.compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._checked_runner: Any = None
        self._busy = False  # some request holds request-local state

    # -- lifecycle -------------------------------------------------------------------------

    def check_runner(self, runner) -> None:
        if runner is not self._checked_runner:
            attrs = RUNNER_ATTRIBUTES + (("mrope_positions.gpu",) if runner.uses_mrope else ())
            verify_runner(runner, attrs)
            self._checked_runner = runner

    @_clears_context
    def on_update_states(self, runner, scheduler_output) -> None:
        self.seed_draws.restore(runner)
        self.records.apply(scheduler_output)
        self._note_idle()

    def _note_idle(self) -> None:
        """Logs once when the last request's state is gone (operators watch memory by it)."""
        live = len(self.records) > 0 or self.drafter.num_requests > 0
        if self._busy and not live:
            log_idle(self.drafter.memory_stats())
        self._busy = live

    # -- layout ----------------------------------------------------------------------------

    @_clears_context
    def begin_step(self, runner, scheduler_output) -> None:
        """Lays out the step after vLLM prepared its inputs; moves tree nodes' positions."""
        t0 = time.perf_counter()
        self.scope.clear()
        batch = runner.input_batch
        n = batch.num_reqs
        req_ids = list(batch.req_ids[:n])
        num_sched = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids],
                             np.int64)
        num_tokens = int(num_sched.sum())
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        proposals = {r: as_scheduled(tree, laid, scheduled.get(r, ()))
                     for r, (tree, laid) in self.records.take_proposals(req_ids).items()}
        plan = build_plan(req_ids, num_sched, runner.query_start_loc.np[:n + 1],
                          scheduled, proposals,
                          batch.num_computed_tokens_cpu[:n], batch.num_prompt_tokens[:n])
        rewrite_positions(runner.positions,
                          runner.mrope_positions.gpu if runner.uses_mrope else None, plan)
        # The decision's outcome is learnt from this step only if it runs the drafts decided:
        # the scheduler may run fewer (vLLM's grammar cuts a structured-output request's
        # drafts at the first token it rejects), and then the step is not the decision's.
        decision = self._decision
        if decision is not None and decision.level != int(plan.num_drafts.sum()):
            decision = None
        ctx = StepContext(plan, proposals=proposals, idle=self.idle_mode.step(plan, proposals),
                          decision=decision,
                          kv_views=self.settings.eager and num_tokens <= KV_VIEWS_UP_TO)
        self._decision = None
        if not ctx.idle and self.compute_logits is not None:
            t1 = time.perf_counter()
            ctx.seeding = self.seeder.plan(plan, batch.token_ids_cpu, self.records)
            ctx.timing.seeding += time.perf_counter() - t1  # inside work (from t0)
        step = self.clock.step_started(num_tokens, decode_context(plan),
                                       int(plan.num_drafts.sum()), bool(plan.trees))
        if step is not None:
            self.budget.observe_step(*step)
            if self._outcome is not None:
                self.budget.observe_outcome(self._outcome[0], step[1], self._outcome[1])
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug("RECAP budget outcome: %s",
                                 self._outcome[0].outcome(step[1], self._outcome[1]))
        self._outcome = None
        self.stats["steps"] += 1
        self.stats["idle_steps"] += int(ctx.idle)
        self.stats["tree_requests"] += len(plan.trees)
        ctx.timing.work += time.perf_counter() - t0
        self.scope.install(ctx)

    # -- verification ----------------------------------------------------------------------

    @_clears_context
    def sample(self, runner, original, logits: torch.Tensor, spec_decode_metadata) -> Any:
        """vLLM's sampler, then tree acceptance over its output -- or, in a step RECAP verifies
        whole, RECAP's walks alone (:meth:`_verifies_whole_step`); keeps the step's rows.

        Seeded sampled requests' generators are first set to their seed streams' positions
        (:mod:`~vllm_recap.vllm.seeded`), so vLLM's sampler draws each position as without
        speculation, and their drafted rows are verified here (chains too)."""
        self.seed_draws.align(runner, self._seed_stream)
        out = self._sample(runner, original, logits, spec_decode_metadata)
        self.seed_draws.hold_discarded(runner)
        return out

    def _sample(self, runner, original, logits: torch.Tensor, spec_decode_metadata) -> Any:
        ctx = self.scope.current
        if ctx is not None and logits is not None and ctx.idle:
            out = self._sample_processed_roots(runner, ctx, logits)
            if out is not None:
                return out
        if ctx is None or logits is None or ctx.idle:
            return original(logits, without_empty_drafts(spec_decode_metadata))
        plan = ctx.plan
        got = (list(spec_decode_metadata.num_draft_tokens) if spec_decode_metadata is not None
               else [0] * len(plan.req_ids))
        if got != plan.num_drafts.tolist():
            raise RuntimeError(f"vllm-recap step plan out of sync with vLLM: drafts {got} "
                               f"scheduled, {plan.num_drafts.tolist()} planned")
        t0 = time.perf_counter()
        ids, probs = topk_rows(logits, self.config.top_k)
        rows = StepRows(ids, probs, node_tokens_of_rows(plan, runner.input_ids.np))
        trees = None
        if self._verifies_whole_step(runner, plan):
            plan.verified = whole_step_slots(plan)
            self.stats["whole_steps"] += 1
        else:
            seeded = [i for i, r in enumerate(plan.req_ids)
                      if plan.num_drafts[i] and self._facts(runner, r).seeded]
            if seeded:  # vLLM's rejection sampler would draw their chains another way
                plan.verified = slots_with_chains(plan, seeded)
        if plan.verified:  # before vLLM's sampler, which may edit the logits in place
            facts = [self._facts(runner, plan.req_ids[t.batch_index]) for t in plan.verified]
            trees = prepare_trees(plan, logits, rows.node_tokens, runner,
                                  keep_rows=any(f.logprobs for f in facts),
                                  plain=all(f.plain for f in facts),
                                  argmax=ids[:, 0] if top1_is_argmax(logits) else None,
                                  top_k=self.config.top_k, top_ids=ids,
                                  history_of=self._history,
                                  seeds_of=lambda r, n: self._position_seeds(runner, r, n))
            if trees.memory_rows is not None:  # rows of processed distributions replace raw
                flat, processed_ids, processed_probs = trees.memory_rows
                ids[flat], probs[flat] = processed_ids, processed_probs
        if len(plan.verified) < len(plan.req_ids):  # before vLLM's sampler edits the logits
            self._process_step_rows(runner, plan, logits, rows)
        if trees is not None and len(plan.verified) == len(plan.req_ids) and trees.raw is None:
            # Every request is verified here and none wants logprobs: vLLM's rejection sampler
            # would process every draft row as a chain (top-k/top-p sorts over the vocabulary
            # included) only to be overwritten. Its output is built here instead.
            out = tree_output(trees, plan, logits.device)
            t1 = t2 = time.perf_counter()
        else:
            t1 = time.perf_counter()
            out = original(logits, without_empty_drafts(spec_decode_metadata))
            t2 = time.perf_counter()
            if trees is not None:
                write_trees(trees, plan, out, runner.model_config.logprobs_mode)
        if trees is not None:
            ctx.accepted = trees.accepted(plan)
            self.stats["off_chain_accepts"] += sum(map(off_chain, ctx.accepted.values()))
            self.stats["kv_compactions"] += compact_kv(ctx.kv_stash, ctx.accepted)
        ctx.kv_stash.clear()
        ctx.rows = rows
        ctx.timing.work += (t1 - t0) + (time.perf_counter() - t2)
        return out

    def _sample_processed_roots(self, runner, ctx: StepContext, logits: torch.Tensor):
        """An idle step's output when RECAP verifies it whole and some request processes its
        rows (penalties, masks; plain greedy steps keep vLLM's argmax): each root's token
        is the argmax of its processed row, decided from the raw top K where it can be, as in
        a drafted step. vLLM's sampler would apply the penalties and sort the whole
        vocabulary for Qwen2.5-VL's top_k 1 / top_p 0.001 (~5 ms of a 24 ms step at
        concurrency 4, bf16 SmolLM2). None: vLLM's sampler samples the step -- also on a
        device, where its sort runs on the device and this walk would add host round trips
        to steps that idle to be cheap (not measured there)."""
        plan = ctx.plan
        if logits.device.type != "cpu" or not self._verifies_whole_step(runner, plan) \
                or all(self._facts(runner, r).plain for r in plan.req_ids):
            return None
        t0 = time.perf_counter()
        ids, _ = topk_rows(logits, self.config.top_k)
        plan.verified = whole_step_slots(plan)
        trees = prepare_trees(plan, logits, node_tokens_of_rows(plan, runner.input_ids.np),
                              runner, keep_rows=False, top_k=self.config.top_k, top_ids=ids,
                              history_of=self._history)
        out = tree_output(trees, plan, logits.device)
        self.stats["whole_steps"] += 1
        ctx.timing.work += time.perf_counter() - t0
        return out

    def _verifies_whole_step(self, runner, plan) -> bool:
        """Does RECAP verify this step's every request itself, chains and roots alone too?

        Yes when every request is a decode (its root and drafts, no prompt chunk) and is
        greedy-equivalent, tree-eligible and wants no logprobs: the argmax of the processed
        rows then decides exactly as vLLM's sampler would, and vLLM's sampler need not run.
        It matters under settings that process rows: vLLM's rejection sampler applies the
        penalties and sorts the whole vocabulary for top-k/top-p in every draft row
        (Qwen2.5-VL's recommended settings at concurrency 4, bf16 SmolLM2: drafted steps of
        chains ran 57-70 ms against 24 ms without drafts), and its plain sampler does the
        same for every root. Sampled requests keep vLLM's sampler (its generator use is
        vLLM's). Chains need no tree attention: single-path engines (``draft_mode`` chain, or
        trees switched off at model load) verify their steps this way too.
        """
        if plan.num_scheduled.tolist() != (plan.num_drafts + 1).tolist():
            return False
        for req_id in plan.req_ids:
            facts = self._facts(runner, req_id)
            if not facts.trees or facts.logprobs or facts.kind != "greedy":
                return False
        return True

    def input_fits(self, runner, common_attn_metadata) -> bool:
        """RECAP runs every step: it caps each request's drafts by its own room to
        ``max_model_len`` (vLLM's rule stops drafting for the whole batch when any one
        request is near the limit)."""
        return common_attn_metadata is not None

    # -- drafting --------------------------------------------------------------------------

    @_clears_context
    def propose(self, runner, scheduler_output, sampled_token_ids: list[list[int]],
                hidden_states: torch.Tensor) -> list[list[int]]:
        """Feeds the step's rows to the drafter, commits accepted tokens, proposes drafts.

        Returns:
            [B] draft token lists in batch order (a flattened tree, parents first, or a chain).
        """
        ctx = self.scope.current
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if ctx is None:
            return drafts
        # An idle step has no rows: it commits its tokens and watches for continuations
        # (see WATCH_MATCH); a step without rows otherwise proposes nothing.
        watching = ctx.rows is None and ctx.idle and WATCH_MATCH > 0
        if ctx.rows is None and not watching:
            self._free_finished(runner, ctx, sampled_token_ids)
            self.clock.step_finished(ctx.timing)
            return drafts
        t0 = time.perf_counter()
        if not watching:
            self._seed_prompts(runner, ctx, hidden_states)
        rooms = [self._advance(runner, ctx, i, sampled, observe=not watching)
                 for i, sampled in enumerate(sampled_token_ids)]
        if ctx.decision is not None:
            self._outcome = (ctx.decision, sum(max(len(s) - 1, 0) for s in sampled_token_ids))
        decoding = [i for i, room in enumerate(rooms) if room > 0]
        cap = self._node_budget(len(decoding))
        # batch_node_budget bounds every draft node of the step, continuations included (the
        # drafter adds those on top of its memory-node budget; trees are laid out best node
        # first, so the cut keeps the best).
        batch_cap = (self.config.batch_node_budget // len(decoding)
                     if self.config.batch_node_budget and decoding else None)
        drafting, drain = decoding, None
        # an idle step proposes continuations only, of plain requests whose last tokens recur
        # (none: the step is done, no drain bookkeeping)
        watched = ([i for i in decoding if self._facts(runner, ctx.plan.req_ids[i]).plain
                    and self.drafter.matched_length(ctx.plan.req_ids[i]) >= WATCH_MATCH]
                   if watching else decoding)
        # [B] tokens per request (plain Python: a numpy call ~15 us here)
        lengths = (runner.input_batch.num_tokens_no_spec.tolist()
                   if self.adaptive and watched else [])
        if self.adaptive and self.drain.draining and watched:
            # Only the requests the draining run waits for may shorten it (and only theirs
            # are worth proposing: a proposal costs ~0.1-0.2 ms per request).
            prefilling = [i for i, sampled in enumerate(sampled_token_ids) if not sampled]
            drafting, drain = longest_requests(decoding, self._remaining(runner, ctx, lengths),
                                               prefilling)
            self.stats["drain_steps"] += 1
            self.stats["drain_decoding"] += len(decoding)
            self.stats["drain_longest"] += len(drafting)
        if watching:
            cap = 0
            drafting = [i for i in drafting if i in watched]
        trees = {i: self._draft(runner, ctx.plan.req_ids[i], min(cap, rooms[i]),
                                rooms[i] if batch_cap is None else min(rooms[i], batch_cap))
                 for i in drafting}
        counts, chain = {i: cap for i in trees}, False
        if self.adaptive and trees:
            # The budget verifies a prefix of each tree: lay the best nodes first, so a prefix
            # of b nodes is the best b-node subtree (the builders' layout puts the whole best
            # chain first: at b = 8 that verified a chain of 8 where a fixed 8-node budget
            # builds a tree of 8, and Spec-Bench ran 1.35x against the fixed budget's 1.51x).
            trees = {i: tree.best_first() for i, tree in trees.items()}
            kinds = [self._kind(runner, ctx.plan.req_ids[i]) for i in trees]
            # The step's context, as the clock keys the costs it measures: every decoding
            # request's (a draining batch proposes the longest requests only, and their
            # context alone was a bucket no step measured, so the budget never drafted).
            context = sum(lengths[i] for i in decoding) / len(decoding)
            # The step's draft nodes go to the requests whose nodes are likeliest accepted,
            # and each size is priced as trees and as the trees' best chains: a chain skips
            # the tree attention path and acceptance, and on a 2-core CPU the off-chain nodes
            # of a small tree accepted too little to pay for that (Spec-Bench, bf16: a fixed
            # 4-node tree 1.69 tokens per pass at 33.8 ms, chains 1.67 at 30.0 ms).
            # the decoding requests that do not draft run one token each regardless
            fixed = next_prefill_tokens(ctx.plan) + len(decoding) - len(trees)
            self.budget.choose(list(trees.values()), fixed, kinds, context, chains=True,
                               drain=drain)
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("RECAP budget (%d decoding, context %.0f): %s", len(decoding),
                             context, self.budget.explain())
            counts = dict(zip(trees, self.budget.last_counts))
            chain = self.budget.last_chain
            self._decision = self.budget.last_decision
        for i, tree in trees.items():
            # Every rank records the same full tree; only the count sent to the scheduler
            # (rank 0's, from its clock) is local, and the next layout cuts by what vLLM
            # actually scheduled. The chosen nodes go out depth first (see
            # DraftTree.depth_first: CPU tree attention then needs no permutation and an
            # accepted best chain no KV compaction).
            record = self.records.get(ctx.plan.req_ids[i])
            record.proposal = tree
            record.laid = ((tree.first_path() if chain else tree).truncate(1 + counts[i])
                           .depth_first())
            drafts[i] = record.laid.draft_tokens.tolist()
        self.stats["watched_steps"] += int(watching and any(drafts))
        self.metrics.maybe_log(len(self.records), self.drafter.acceptance_snapshot)
        self._note_idle()
        ctx.timing.work += time.perf_counter() - t0
        if ctx.seeding is not None:  # what this step's prompt rows cost, all parts
            self.seeder.observe(ctx.seeding.num_rows, ctx.timing.seeding,
                                ctx.seeding.head_seconds)
        self.clock.step_finished(ctx.timing)
        return drafts

    def end_step(self) -> None:
        self.scope.clear()

    # -- per request -----------------------------------------------------------------------

    def _advance(self, runner, ctx: StepContext, i: int, sampled: list[int],
                 observe: bool = True) -> int:
        """Observes this step's rows (``observe``: an idle step has none) and commits its
        tokens for batch row ``i``.

        Returns:
            How many draft tokens the request may get next (0: none -- a prefill chunk, a
            finished request, or one at the model's length limit).
        """
        if not sampled:
            return 0
        batch, plan = runner.input_batch, ctx.plan
        req_id = plan.req_ids[i]
        record = self.records.get(req_id)
        n_tokens = int(batch.num_tokens_no_spec[i])
        before = n_tokens - len(sampled)  # tokens committed before this step
        self._catch_up(req_id, record, batch.token_ids_cpu[i], before)
        parents = plan.parents[i]
        if observe:
            s, e = plan.logits_starts[i], plan.logits_starts[i + 1]
            rows = ctx.rows
            self.drafter.observe(req_id, rows.node_tokens[s:e], parents, rows.ids[s:e],
                                 rows.probs[s:e])
        accepted = len(sampled) - 1
        if observe and len(parents) > 1:
            self.metrics.record(len(parents) - 1, int(self._depths(ctx, req_id, parents).max()),
                                accepted)
            tree = ctx.proposals.get(req_id)
            if tree is not None:
                n = len(parents)
                # which nodes were accepted: the walked path of a tree, the first ones of a chain
                nodes = ctx.accepted.get(i, accepted)
                self.budget.observe_tree(parents, tree.scores[:n], nodes, tree.depths[:n],
                                         self._kind(runner, req_id),
                                         None if tree.sources is None else tree.sources[:n])
        self.drafter.commit(req_id, sampled)
        record.num_committed = n_tokens
        params = getattr(runner.requests.get(req_id), "sampling_params", None)
        if surely_finished(params, sampled, n_tokens - int(batch.num_prompt_tokens[i]),
                           n_tokens, self.settings.max_model_len):
            self.records.stop(req_id, keep_salt=False)
            return 0
        return min(self.settings.num_spec_tokens, self.settings.max_model_len - n_tokens - 1)

    def _remaining(self, runner, ctx: StepContext, lengths: list[int]) -> list[int]:
        """[B] most tokens each request of the batch (of ``lengths`` tokens) may still commit
        (`remaining_tokens`)."""
        prompts = runner.input_batch.num_prompt_tokens.tolist()
        return [remaining_tokens(getattr(runner.requests.get(r), "sampling_params", None),
                                 lengths[i], prompts[i], self.settings.max_model_len)
                for i, r in enumerate(ctx.plan.req_ids)]

    def _free_finished(self, runner, ctx: StepContext, sampled_token_ids) -> None:
        """Frees requests this step without rows finished (the scheduler reports them only in
        a next step, which may never come once the engine goes quiet)."""
        batch = runner.input_batch
        for i, sampled in enumerate(sampled_token_ids):
            req_id = ctx.plan.req_ids[i]
            if not sampled or req_id not in self.records:
                continue
            n_tokens = int(batch.num_tokens_no_spec[i])
            params = getattr(runner.requests.get(req_id), "sampling_params", None)
            if surely_finished(params, sampled, n_tokens - int(batch.num_prompt_tokens[i]),
                               n_tokens, self.settings.max_model_len):
                self.records.stop(req_id, keep_salt=False)
        self._note_idle()

    def _catch_up(self, req_id: str, record, tokens: np.ndarray, before: int) -> None:
        """Brings the drafter's history to vLLM's ``tokens[:before]``.

        The drafter misses tokens when vLLM skipped the proposer in a step (its rows are lost,
        the tokens are not): those are committed here from vLLM's own history. A request the
        drafter does not know yet (first decode step, or resumed after preemption) starts
        from its whole history with the prompt rows collected during prefill.
        """
        if not self.drafter.has_request(req_id) or record.num_committed > before:
            if self.drafter.has_request(req_id):
                self.drafter.stop(req_id)
            self.drafter.start(req_id, tokens[:before], record.seed.take(), record.salt)
        elif record.num_committed < before:
            self.drafter.commit(req_id, tokens[record.num_committed:before].tolist())
            self.stats["resynced"] += 1
        record.num_committed = before

    def _draft(self, runner, req_id: str, node_budget: int, room: int) -> DraftTree:
        """The request's full tree (``node_budget`` nodes plus the suffix path, at most
        ``room`` drafts); its best chain alone for requests that cannot verify a tree; no
        drafts for a seeded sampled request whose draws RECAP cannot replay (a tree-ineligible
        one, or vLLM's sampler is not its CPU one): vLLM's sampler alone then draws its
        tokens, as without speculation."""
        tree = self.drafter.propose(req_id, node_budget=node_budget)
        facts = self._facts(runner, req_id)
        if facts.seeded and not (facts.trees and self.seed_draws.replays(runner)):
            return tree.truncate(1)
        if not self.tree_mode or not facts.trees:
            tree = tree.truncate(1 + tree.chain_len)  # the best chain sits at 1..L
        return tree.truncate(1 + room)

    def _seed_stream(self, req_id: str, seed: int) -> SeedStream:
        """The request's seed stream (kept on its record, freed with it)."""
        record = self.records.get(req_id)
        if record.draws is None or record.draws.seed != seed:
            record.draws = SeedStream(seed)
        return record.draws

    def _position_seeds(self, runner, req_id: str, rows: int) -> tuple[int, ...] | None:
        """The seeds of a seeded sampled request's rows at depth 0 .. rows - 1 this step
        (:meth:`~vllm_recap.vllm.seeded.SeedDraws.position_seeds`), None for other requests."""
        if not self._facts(runner, req_id).seeded:
            return None
        return self.seed_draws.position_seeds(runner, req_id, rows, self._seed_stream)

    def _facts(self, runner, req_id: str) -> SamplingFacts:
        """The request's sampling facts, kept on its record while its params stay the same."""
        params = getattr(runner.requests.get(req_id), "sampling_params", None)
        record = self.records.get(req_id)
        if record.sampling is None or record.sampling.params is not params:
            record.sampling = SamplingFacts.of(params)
        return record.sampling

    def _kind(self, runner, req_id: str) -> str:
        """The request's acceptance rule, for the budget's calibration."""
        return self._facts(runner, req_id).kind

    @staticmethod
    def _depths(ctx: StepContext, req_id: str, parents: np.ndarray) -> np.ndarray:
        tree = ctx.proposals.get(req_id)
        if tree is not None:
            return tree.depths[:len(parents)]
        return np.arange(len(parents))  # a chain

    def _node_budget(self, num_decoding: int) -> int:
        """Per-request memory draft nodes: the configured budget, shrunk so the whole batch
        stays within ``batch_node_budget`` (0 = no batch limit); none above
        ``memory_nodes_up_to`` decoding requests (adaptive budget: continuations only)."""
        up_to = self.config.memory_nodes_up_to
        if self.adaptive and up_to and num_decoding > up_to:
            return 0
        budget = self.config.node_budget
        if self.config.batch_node_budget and num_decoding > 0:
            budget = min(budget, self.config.batch_node_budget // num_decoding)
        return max(0, budget)

    def _seed_prompts(self, runner, ctx: StepContext, hidden_states: torch.Tensor) -> None:
        if ctx.seeding is None or self.compute_logits is None:
            return
        t0 = time.perf_counter()
        self.seeder.finish(ctx.seeding, ctx.plan, hidden_states, self.compute_logits,
                           self.records, lambda r: self._memory_state(runner, r, prompt=True))
        ctx.timing.seeding += time.perf_counter() - t0

    def _memory_state(self, runner, req_id: str, prompt: bool = False) -> RequestSampling | None:
        """The request's memory-row state (:func:`~vllm_recap.vllm.memory_rows.memory_state`;
        ``prompt``: of its prompt alone), None for raw rows (plain greedy requests, read
        from the facts kept on their records)."""
        state = runner.requests.get(req_id)
        if state is None or req_id not in self.records or self._facts(runner, req_id).plain:
            return None
        return memory_state(state.sampling_params, state.prompt_token_ids,
                            () if prompt else state.output_token_ids,
                            None if prompt else self.records.get(req_id).history)

    def _history(self, req_id: str) -> TokenHistory | None:
        """The request's token history (kept on its record), None without a record."""
        return self.records.get(req_id).history if req_id in self.records else None

    def _process_step_rows(self, runner, plan, logits: torch.Tensor, rows: StepRows) -> None:
        """The memory rows of processed requests without a tree this step in their processed
        form (see memory_rows; tree rows were processed with their walks)."""
        starts = plan.logits_starts.tolist()
        done = {t.batch_index for t in plan.verified}
        for i, req_id in enumerate(plan.req_ids):
            if i in done or starts[i + 1] == starts[i]:
                continue
            state = self._memory_state(runner, req_id)
            if state is None:
                continue
            s, e = starts[i], starts[i + 1]
            drafts = rows.node_tokens[s + 1:e].tolist()  # a chain's: row d's path is d drafts
            process_rows(logits, np.arange(s, e), rows.ids, rows.probs, state,
                         [drafts[:d] for d in range(e - s)])

    # -- the target model's LM head (prompt rows ride along; see vllm_recap.vllm.seeding) ----

    def bind_model(self, target_model) -> None:
        """Takes the target's ``compute_logits`` (prompt rows) and puts :meth:`_logits` in its
        place, plus a forward hook that keeps each step's hidden states for it."""
        self.compute_logits = target_model.compute_logits
        target_model.compute_logits = self._logits
        target_model.register_forward_hook(self._keep_hidden)

    def _keep_hidden(self, module, args, output) -> None:
        ctx = self.scope.current
        if ctx is not None and ctx.seeding is not None and isinstance(output, torch.Tensor):
            ctx.seeding.hidden = output

    def _logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's ``compute_logits``; in a step with prompt rows to seed, the step's
        own call (one row per request plus drafts) carries them too, and their logits are
        split off for :meth:`_seed_prompts`."""
        ctx = self.scope.current
        step = ctx.seeding if ctx is not None else None
        n = hidden_states.shape[0]
        timed = ctx is not None and hidden_states.device.type == "cpu"
        if (step is None or step.logits is not None or step.num_rows == 0
                or n != int(ctx.plan.logits_starts[-1])):
            return self._own_logits(hidden_states, timed)
        t0 = time.perf_counter()
        extra = self.seeder.fused_inputs(step, ctx.plan)
        if extra is None:
            return self._own_logits(hidden_states, timed)
        joined = torch.cat([hidden_states, extra.to(hidden_states.dtype)])
        t1 = time.perf_counter()
        logits = self.compute_logits(joined)
        t2 = time.perf_counter()
        # The rows' share of the call, where a call of the step's own rows was measured: the
        # step is then still a cost sample for the budget (see LmHeadTimes).
        own = self.lm_head.estimate(n) if timed else None
        head = max(0.0, t2 - t1 - own) if own is not None else 0.0
        if timed:  # a sample of the call at its whole row count (prices later steps' rows)
            self.lm_head.observe(joined.shape[0], t2 - t1)
        spent = (t1 - t0) + head
        step.head_seconds += head
        ctx.timing.seeding += spent
        ctx.timing.work += spent
        ctx.timing.shared_lm_head = own is None
        step.logits = logits[n:]
        return logits[:n]

    def _own_logits(self, hidden_states: torch.Tensor, timed: bool) -> torch.Tensor:
        """The target's ``compute_logits`` of the step's own rows (timed: see LmHeadTimes)."""
        if not timed:
            return self.compute_logits(hidden_states)
        t0 = time.perf_counter()
        logits = self.compute_logits(hidden_states)
        self.lm_head.observe(hidden_states.shape[0], time.perf_counter() - t0)
        return logits
