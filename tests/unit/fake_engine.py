"""A fake vLLM engine step loop that drives the RECAP step driver in milliseconds.

It plays the parts of vLLM around the runner seams -- scheduler (prefill chunks, drafts capped
at the model's length, finished / aborted / preempted / resumed requests), input batch,
forward pass and chain rejection sampler, bookkeeping -- with ``SimpleNamespace`` objects and
a toy target whose next-token logits depend on the last two tokens of a context. The forward
pass reads the step context exactly as an attention backend does (tree requests see their
path, not slot order) and checks the positions the driver wrote. Greedy decoding of the toy
target is the ground truth every speculative run must reproduce token for token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from vllm_recap.core.config import BudgetPolicy, RecapConfig
from vllm_recap.core.drafter import Drafter
from vllm_recap.vllm.driver import DriverSettings, StepDriver

VOCAB = 64


class ToyTarget:
    """Logits [V] after a context: a peaked function of its last two tokens, plus noise."""

    def __init__(self, vocab: int = VOCAB, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.table = rng.normal(0.0, 1.0, (vocab, vocab, vocab)).astype(np.float32)
        a, b = np.meshgrid(np.arange(vocab), np.arange(vocab), indexing="ij")
        # a favourite successor per pair, with a runner-up: drafts get accepted often
        self.table[a, b, (5 * b + 1) % vocab] += 4.0  # mostly a function of the last token
        self.table[a, b, (7 * a + b + 2) % vocab] += 3.5  # the one before can overrule it

    def logits(self, context: list[int]) -> np.ndarray:
        a = context[-2] if len(context) >= 2 else 0
        return self.table[a, context[-1]]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(int(np.argmax(self.logits(tokens))))
        return tokens[len(prompt):]


@dataclass
class FakeRequest:
    prompt: list[int]
    max_tokens: int
    params: object
    salt: str | None = None
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    drafts: list[int] = field(default_factory=list)
    new: bool = True
    paused: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Params:
    """The SamplingParams fields the driver reads, as a struct with defaults (importing vLLM's
    own class costs seconds; the engine tests use the real one)."""

    __struct_fields__ = ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                         "frequency_penalty", "repetition_penalty", "ignore_eos", "max_tokens",
                         "min_tokens", "stop_token_ids", "logit_bias", "allowed_token_ids",
                         "bad_words", "logprobs")

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    logit_bias: dict | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    logprobs: int | None = None
    eos_token_id: int | None = None
    bad_words_token_ids: list[list[int]] | None = None

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids)


def greedy_params(**kw) -> Params:
    return Params(temperature=0.0, ignore_eos=True, **kw)


def make_driver(config: RecapConfig | None = None, *, max_model_len: int = 512,
                num_spec_tokens: int | None = None, tree_mode: bool = True) -> StepDriver:
    # fixed: the adaptive budget would decide from this process's timings (tests set it)
    config = config or RecapConfig(node_budget=8, suffix_len=4, prompt_seed_rows=32,
                                   budget_policy=BudgetPolicy.FIXED)
    drafter = Drafter(config, VOCAB)
    n_spec = num_spec_tokens or config.node_budget + config.suffix_len
    return StepDriver(config, drafter, DriverSettings(n_spec, max_model_len,
                                                      np.zeros(VOCAB, np.bool_), tree_mode))


class FakeEngine:
    """Runs requests through one or more step drivers (ranks) in lockstep.

    Args:
        drivers: rank 0 first; every rank sees the same batch, rank 0's drafts are scheduled.
        chunk: prefill tokens per request and step.
        max_model_len: the length limit (drafts are cut to stay below it, as vLLM does).
        device: where the runner's position tensors live ("meta" skips the position check).
    """

    def __init__(self, drivers: list[StepDriver], target: ToyTarget | None = None,
                 chunk: int = 16, max_model_len: int = 512, device: str = "cpu",
                 uses_mrope: bool = False, fused_lm_head: bool = True) -> None:
        self.drivers = drivers
        self.target = target or ToyTarget()
        self.chunk = chunk
        self.max_model_len = max_model_len
        self.device = device
        self.uses_mrope = uses_mrope
        self.requests: dict[str, FakeRequest] = {}
        self.finished: dict[str, list[int]] = {}
        self._gone: set[str] = set()
        self._preempted: set[str] = set()
        self._resume: set[str] = set()
        self.skip_propose_steps: set[int] = set()
        # The scheduler's check of a request's drafts (vLLM's structured-output manager cuts
        # them at the first token its grammar rejects): (request id, drafts) -> the kept ones.
        self.validate = lambda req_id, drafts: drafts
        self.step_count = 0
        self.off_chain_accepts = 0
        self.tree_steps = 0
        self._contexts: list[list[int]] = []  # every flat token's context so far (see _forward)
        self.plans: list[list] = []  # per step, per rank: (parents per request, tree rows)
        # Each rank's 'model': the forward hook and compute_logits seams of a vLLM model, so
        # prompt rows ride along with the step's own LM-head call (fused_lm_head=False: the
        # rows get calls of their own, as where no forward hook runs)
        self.models = [_FakeModel(self) for _ in drivers]
        for d, model in zip(drivers, self.models):
            if fused_lm_head:
                d.bind_model(model)
            else:
                d.compute_logits = self._seed_logits

    # -- requests --------------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params=None,
            salt: str | None = None) -> None:
        params = params or greedy_params()
        params.max_tokens = max_tokens  # what vLLM's scheduler (and surely_finished) reads
        self.requests[req_id] = FakeRequest(list(prompt), max_tokens, params, salt)

    def abort(self, req_id: str) -> None:
        if self.requests.pop(req_id, None) is not None:
            self._gone.add(req_id)

    def preempt(self, req_id: str) -> None:
        """As vLLM's recompute preemption: the KV is dropped, prompt + output re-prefilled."""
        req = self.requests[req_id]
        req.num_computed, req.drafts, req.paused = 0, [], True
        self._preempted.add(req_id)

    def run(self, max_steps: int = 1000) -> dict[str, list[int]]:
        while self.requests and self.step_count < max_steps:
            self.step()
        return self.finished

    # -- one engine step -------------------------------------------------------------------

    def step(self) -> None:
        so, runner = self._schedule()
        if runner is None:  # nothing scheduled: vLLM only updates its states
            for driver in self.drivers:
                driver.on_update_states(None, so)
            self.step_count += 1
            return
        runners = [runner] + [self._copy(runner) for _ in self.drivers[1:]]
        results = [self._run_rank(d, m, so, r)
                   for d, m, r in zip(self.drivers, self.models, runners)]
        sampled_lists, drafts = results[0]
        for rank, (other_sampled, _) in enumerate(results[1:], 1):
            assert other_sampled == sampled_lists, f"rank {rank} committed other tokens"
        self._bookkeep(runner, sampled_lists, drafts)
        self.step_count += 1

    def _run_rank(self, driver: StepDriver, model: "_FakeModel", so, runner):
        driver.on_update_states(runner, so)
        driver.begin_step(runner, so)
        ctx = driver.scope.current
        logits, hidden = self._forward(runner, ctx, model)
        md = None
        n_drafts = [len(so.scheduled_spec_decode_tokens.get(r, [])) for r in runner.input_batch.req_ids]
        if any(n_drafts):
            md = SimpleNamespace(num_draft_tokens=n_drafts)
        out = driver.sample(runner, lambda lg, m: self._chain_sampler(runner, lg, n_drafts),
                            logits, md)
        plan = ctx.plan
        self.plans[-1].append(([p.tolist() for p in plan.parents],
                               [t.batch_index for t in plan.trees]))
        for b, nodes in ctx.accepted.items():
            self.tree_steps += 1
            self.off_chain_accepts += int(np.any(nodes != np.arange(1, len(nodes) + 1)))
        sampled = self._valid(runner, out.sampled_token_ids)
        batch = runner.input_batch  # vLLM's bookkeeping runs before the proposer
        for i, toks in enumerate(sampled):
            n = int(batch.num_tokens_no_spec[i])
            batch.token_ids_cpu[i, n:n + len(toks)] = toks
            batch.num_tokens_no_spec[i] = n + len(toks)
        if self.step_count in self.skip_propose_steps:  # vLLM did not call the proposer
            drafts = [[] for _ in sampled]
        else:
            drafts = driver.propose(runner, so, sampled, hidden)
        driver.end_step()
        return sampled, drafts

    def _schedule(self):
        req_ids, num_sched, new, drafts_of = [], {}, [], {}
        resumed = set()
        for rid, req in self.requests.items():
            if req.paused:  # preempted in the previous step: skips this one, resumes next
                req.paused = False
                self._resume.add(rid)
                continue
            if rid in self._resume:
                resumed.add(rid)
                self._resume.discard(rid)
            n_tok = len(req.tokens)
            if req.num_computed < n_tok - 1 or req.num_computed == 0:
                n = min(self.chunk, n_tok - req.num_computed)  # (re)prefill chunk
            else:
                room = self.max_model_len - req.num_computed - 1
                req.drafts = self.validate(rid, req.drafts[:max(0, room - 1)])
                n = 1 + len(req.drafts)
                drafts_of[rid] = list(req.drafts)
            req_ids.append(rid)
            num_sched[rid] = n
            if req.new:
                new.append(SimpleNamespace(req_id=rid, recap_cache_salt=req.salt))
                req.new = False
        so = SimpleNamespace(
            finished_req_ids=set(self._gone), preempted_req_ids=set(self._preempted),
            scheduled_new_reqs=new,
            scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=resumed),
            num_scheduled_tokens=num_sched,
            scheduled_spec_decode_tokens={r: d for r, d in drafts_of.items() if d},
            total_num_scheduled_tokens=sum(num_sched.values()))
        self._gone, self._preempted = set(), set()
        self.plans.append([])
        return so, (self._runner(req_ids, num_sched) if req_ids else None)

    def _runner(self, req_ids: list[str], num_sched: dict[str, int]):
        b = len(req_ids)
        width = max(len(self.requests[r].tokens) + len(self.requests[r].drafts)
                    for r in req_ids) + 2
        token_ids = np.zeros((b, width), np.int32)
        computed, prompt_len, no_spec, flat, positions = [], [], [], [], []
        for i, rid in enumerate(req_ids):
            req = self.requests[rid]
            token_ids[i, :len(req.tokens)] = req.tokens
            computed.append(req.num_computed)
            prompt_len.append(len(req.prompt))
            no_spec.append(len(req.tokens))
            n = num_sched[rid]
            scheduled = (req.tokens + req.drafts)[req.num_computed:req.num_computed + n]
            flat += scheduled
            positions += list(range(req.num_computed, req.num_computed + n))
        qsl = np.concatenate([[0], np.cumsum([num_sched[r] for r in req_ids])]).astype(np.int32)
        pos = torch.tensor(positions, dtype=torch.int64)
        mrope = pos.expand(3, -1).clone() if self.uses_mrope else None
        return SimpleNamespace(
            input_batch=SimpleNamespace(
                req_ids=list(req_ids), num_reqs=b, token_ids_cpu=token_ids,
                num_computed_tokens_cpu=np.array(computed, np.int32),
                num_prompt_tokens=np.array(prompt_len, np.int32),
                num_tokens_no_spec=np.array(no_spec, np.int32),
                generators={}, req_id_to_index={r: i for i, r in enumerate(req_ids)}),
            query_start_loc=SimpleNamespace(np=qsl),
            discard_request_mask=SimpleNamespace(np=np.zeros(b, bool)),
            positions=pos.to(self.device),
            mrope_positions=SimpleNamespace(gpu=None if mrope is None else mrope.to(self.device)),
            uses_mrope=self.uses_mrope,
            input_ids=_host_buffer(torch.tensor(flat, dtype=torch.int32)),
            requests={r: SimpleNamespace(sampling_params=self.requests[r].params,
                                         prompt_token_ids=self.requests[r].prompt,
                                         output_token_ids=self.requests[r].output,
                                         generator=None)
                      for r in req_ids},
            model_config=SimpleNamespace(logprobs_mode="raw_logprobs"),
            num_sched=num_sched, flat_contexts=None)

    @staticmethod
    def _copy(runner):
        clone = SimpleNamespace(**vars(runner))
        clone.input_batch = SimpleNamespace(**vars(runner.input_batch))
        for name in ("token_ids_cpu", "num_tokens_no_spec"):
            setattr(clone.input_batch, name, getattr(runner.input_batch, name).copy())
        clone.positions = runner.positions.clone()
        if runner.uses_mrope:
            clone.mrope_positions = SimpleNamespace(gpu=runner.mrope_positions.gpu.clone())
        return clone

    def _forward(self, runner, ctx, model):
        """Logits rows (1 + drafts per request) and 'hidden states' (the flat contexts)."""
        plan = ctx.plan
        contexts: list[list[int]] = []  # per flat token: the context its output conditions on
        rows = []
        for i, rid in enumerate(plan.req_ids):
            req = self.requests[rid]
            n = int(plan.num_scheduled[i])
            start = req.num_computed
            d = int(plan.num_drafts[i])
            prefix = req.tokens[:start]
            scheduled = (req.tokens + req.drafts)[start:start + n]
            parents = plan.parents[i]
            for j in range(n):
                if j < n - (d + 1):  # prefill part: causal, no logits row
                    contexts.append(prefix + scheduled[:j + 1])
                    continue
                node = j - (n - (d + 1))
                path, k = [], node
                while k >= 0:
                    path.append(scheduled[n - (d + 1) + k])
                    k = int(parents[k])
                base = prefix + scheduled[:n - (d + 1)]
                contexts.append(base + path[::-1])
                if self.device != "meta":
                    want = len(base) + len(path) - 1
                    got = int(runner.positions[plan.query_starts[i] + j])
                    assert got == want, f"{rid} node {node}: position {got}, expected {want}"
                    if self.uses_mrope:
                        assert (runner.mrope_positions.gpu[:, plan.query_starts[i] + j]
                                == want).all()
                rows.append(len(contexts) - 1)
        # 'hidden states' name contexts in a registry kept across steps: prompt seeding may
        # compute a row from a hidden state of an earlier step
        base = len(self._contexts)
        self._contexts.extend(contexts)
        hidden = model(torch.arange(base, base + len(contexts), dtype=torch.float64)[:, None])
        return model.compute_logits(hidden[torch.tensor(rows)]), hidden

    def _seed_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        idx = hidden[:, 0].long().tolist()
        return torch.from_numpy(np.stack([self.target.logits(self._contexts[i]) for i in idx]))

    def _chain_sampler(self, runner, logits: torch.Tensor, n_drafts: list[int]):
        """vLLM's greedy rejection sampler: a chain, [B, max_spec + 1] padded with -1."""
        width = max(n_drafts) + 1
        out = torch.full((len(n_drafts), width), -1, dtype=torch.int32)
        argmax = logits.argmax(-1)
        row = 0
        for i, rid in enumerate(runner.input_batch.req_ids):
            d = n_drafts[i]
            drafts = self.requests[rid].drafts[:d]
            k = 0
            while k < d and int(argmax[row + k]) == drafts[k]:
                out[i, k] = drafts[k]
                k += 1
            out[i, k] = int(argmax[row + k])
            row += d + 1
        return SimpleNamespace(sampled_token_ids=out, logprobs_tensors=None)

    def _valid(self, runner, sampled: torch.Tensor) -> list[list[int]]:
        lists = []
        for i, rid in enumerate(runner.input_batch.req_ids):
            req = self.requests[rid]
            done_prefill = req.num_computed + runner.num_sched[rid] >= len(req.tokens)
            row = [int(t) for t in sampled[i] if t >= 0]
            lists.append(row if done_prefill else [])
        return lists

    def _bookkeep(self, runner, sampled_lists, drafts) -> None:
        for i, rid in enumerate(runner.input_batch.req_ids):
            req = self.requests[rid]
            n = runner.num_sched[rid]
            if not sampled_lists[i]:
                req.num_computed += n
                continue
            req.output += sampled_lists[i]
            req.num_computed = len(req.tokens) - 1
            req.drafts = list(drafts[i])
            if len(req.output) >= req.max_tokens or len(req.tokens) >= self.max_model_len:
                self.finished[rid] = req.output[:req.max_tokens]
                del self.requests[rid]
                self._gone.add(rid)


class _FakeModel(torch.nn.Module):
    """A rank's model as the driver sees it: ``forward`` returns the step's 'hidden states'
    (context ids, see FakeEngine._forward), ``compute_logits`` the target's rows for them."""

    def __init__(self, engine: FakeEngine) -> None:
        super().__init__()
        self.engine = engine

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.engine._seed_logits(hidden)


def _host_buffer(cpu: torch.Tensor) -> SimpleNamespace:
    """vLLM's ``CpuGpuBuffer`` as the driver reads it: the host tensor and its numpy view."""
    return SimpleNamespace(cpu=cpu, np=cpu.numpy())
