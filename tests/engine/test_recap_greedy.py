"""RECAP in vLLM, greedy: output identical token for token to the same engine without
speculation (float32), for chain and tree verification."""
from __future__ import annotations

import pytest

from benchmarks.harness import spec_counters
from tests.conftest import make_llm
from tests.engine.recap_support import generate_ids, oracle_drafts, recap_proposer
from tests.images import make_image

pytestmark = pytest.mark.engine

MODES = ["tree", "chain"]
# Trees of a fixed size: the adaptive default measures this machine and may well decide that
# drafting does not pay for a tiny model, which would leave nothing to check.
# Prompt seeding is off by default on a CPU (options.DEVICE_DEFAULTS); the tree mode turns it on
# so its rows (fused into the step's LM-head call) stay covered, the others run the defaults.
SPECS = {"tree": {"method": "recap", "budget_policy": "fixed", "node_budget": 8,
                  "prompt_seed_rows": 256},
         "chain": {"method": "recap", "draft_mode": "chain"},
         "adaptive": {"method": "recap"}}


def _params(n=32):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_prompts(tiny_qwen2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    texts = ["The quick brown fox", "1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3", "Once upon a time"]
    return [tok(t)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def tiny_reference(tiny_qwen2, tiny_prompts):
    with make_llm(tiny_qwen2) as llm:
        return generate_ids(llm, tiny_prompts, _params())


@pytest.mark.parametrize("mode", ["tree", "chain", "adaptive"])
def test_tiny_qwen2_identical(tiny_qwen2, tiny_prompts, tiny_reference, mode):
    with make_llm(tiny_qwen2, speculative_config=SPECS[mode]) as llm:
        assert generate_ids(llm, tiny_prompts, _params()) == tiny_reference
        drafts = spec_counters(llm)["drafts"]
        trees = recap_proposer(llm).stats["tree_requests"]
    if mode != "adaptive":  # (the adaptive policy may choose not to draft here)
        assert drafts > 0
        assert (trees > 0) if mode == "tree" else (trees == 0)


def test_a_draining_batch_proposes_for_its_longest_request_only(tiny_qwen2, tiny_prompts):
    """Requests of one length with different ``max_tokens``: once the shortest is done the
    batch drains, and only the request with the most tokens left (read from its sampling
    parameters in vLLM's runner) is proposed; outputs stay identical."""
    n = min(len(p) for p in tiny_prompts)
    prompts = [p[:n] for p in tiny_prompts]
    params = [_params(8), _params(48), _params(24)]
    with make_llm(tiny_qwen2) as llm:
        reference = generate_ids(llm, prompts, params)
    with make_llm(tiny_qwen2, speculative_config=SPECS["adaptive"]) as llm:
        assert generate_ids(llm, prompts, params) == reference
        stats = recap_proposer(llm).stats
    assert stats["drain_steps"] > 0, stats
    assert stats["drain_longest"] < stats["drain_decoding"], stats


def test_tree_with_accepted_off_chain_branches_compacts_kv(tiny_qwen2, tiny_prompts,
                                                           tiny_reference, monkeypatch):
    """Oracle drafts put the true path behind decoy siblings: KV compaction must run and the
    output must still equal plain greedy decoding."""
    refs = [p + r for p, r in zip(tiny_prompts, tiny_reference)]
    with oracle_drafts(monkeypatch, refs, vocab=49152) as calls, \
            make_llm(tiny_qwen2, speculative_config=SPECS["tree"]) as llm:
        out = generate_ids(llm, tiny_prompts, _params())
        proposer = recap_proposer(llm)
        stats, tree = proposer.stats, proposer.metrics.snapshot()
        counters = spec_counters(llm)
        per_pos = next(m.values for m in llm.get_metrics()
                       if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos")
    assert out == tiny_reference
    assert calls["off_chain"] > 0 and stats["kv_compactions"] > 0
    assert counters["accepted_tokens"] / counters["drafts"] > 2  # the oracle is mostly right
    # vLLM's chain counters stay consistent with trees wider than its chain positions
    assert len(per_pos) == proposer.num_spec_tokens and sum(per_pos) == counters["accepted_tokens"]
    assert tree["acceptance_length"] == pytest.approx(1 + counters["accepted_tokens"] / counters["drafts"])
    assert tree["per_depth_acceptance"][0] > 0.9


def test_node_budget_zero_verifies_continuations_only(tiny_qwen2, tiny_prompts, tiny_reference,
                                                     monkeypatch):
    """``node_budget`` 0 (adaptive policy, suffix_mode evidence): trees of continuations alone
    reach vLLM and verify, output equal to plain greedy decoding. The budget is set to verify
    every node offered (the adaptive policy may decline all of them on a tiny model); before
    stop 51's fix the drafter offered none (a root-only tree), so nothing was drafted."""
    from vllm_recap.core.budget import BudgetController
    from vllm_recap.core.drafter import Drafter
    from vllm_recap.core.tree import SOURCE_MEMORY

    def verify_all(self, trees, fixed_tokens, kinds=None, context=0, chains=False, drain=None):
        self.last_counts = [min(t.num_drafts, self.max_budget) for t in trees]
        self.last_chain, self.last_decision = False, None
        self.last_choice = max(self.last_counts, default=0)
        return self.last_choice

    offered = []
    original = Drafter.propose

    def propose(self, req_id, node_budget=None, max_depth=None):
        tree = original(self, req_id, node_budget, max_depth)
        if tree.num_drafts and req_id != "warmup":  # (core.warmup's own drafter)
            offered.append(tree)
        return tree

    monkeypatch.setattr(BudgetController, "choose", verify_all)
    monkeypatch.setattr(Drafter, "propose", propose)
    spec = {"method": "recap", "node_budget": 0}
    with make_llm(tiny_qwen2, speculative_config=spec) as llm:
        out = generate_ids(llm, tiny_prompts, _params())
        drafts = spec_counters(llm)["drafts"]
    assert out == tiny_reference
    assert drafts > 0 and offered
    for tree in offered:  # continuations only: every draft node has a continuation's source
        assert tree.sources is not None and all(tree.sources[1:] & ~SOURCE_MEMORY), tree


def test_sliding_window_layers_stay_exact_on_accepted_off_chain_branches(tiny_gemma3,
                                                                           monkeypatch):
    """Gemma-3's layout (a sliding-window layer of 8 tokens, then a full-attention one):
    past the first few tokens every tree reaches beyond the window, and planted drafts (the
    true path behind decoy siblings) get off-chain nodes accepted, whose path requests must
    see exactly the last 8 positions of their own path in the window layer. Output equals
    plain greedy decoding."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_gemma3)
    texts = ["The quick brown fox jumps over the lazy dog near the river bank",
             "1 2 3 4 5 6 7 8 9 10 11 12", "Once upon a time"]
    prompts = [tok(t)["input_ids"] for t in texts]
    with make_llm(tiny_gemma3) as llm:
        reference = generate_ids(llm, prompts, _params(40))
    refs = [p + r for p, r in zip(prompts, reference)]
    with oracle_drafts(monkeypatch, refs, vocab=len(tok)) as calls, \
            make_llm(tiny_gemma3, speculative_config=SPECS["tree"]) as llm:
        out = generate_ids(llm, prompts, _params(40))
        stats = recap_proposer(llm).stats
    assert out == reference
    assert calls["off_chain"] > 0 and stats["off_chain_accepts"] > 0, (calls, stats)
    assert stats["kv_compactions"] > 0, stats


@pytest.fixture(scope="module")
def vl_batch(tiny_qwen2_vl):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_qwen2_vl)
    items = [("Describe this picture.", (64, 80)), ("What colour dominates?", (112, 56)),
             ("Count the shapes, then list them.", (56, 56)), ("Is it day or night?", (84, 140))]
    batch = []
    for i, (question, size) in enumerate(items):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        batch.append({"prompt": text, "multi_modal_data": {"image": make_image(i, size)}})
    return batch, processor.tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>"])


def _vl_params(setting: str):
    """Plain greedy, or Qwen2.5-VL's recommended settings (its generation_config.json, which
    `vllm serve` applies by default): greedy-equivalent (top_k 1) with a repetition penalty."""
    from vllm import SamplingParams

    if setting == "greedy":
        return _params(24)
    return SamplingParams(temperature=0.1, top_k=1, top_p=0.001, repetition_penalty=1.05,
                          max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def vl_reference(tiny_qwen2_vl, vl_batch):
    with make_llm(tiny_qwen2_vl, limit_mm_per_prompt={"image": 1, "video": 0}) as llm:
        return {s: generate_ids(llm, vl_batch[0], _vl_params(s)) for s in ("greedy", "qwen_vl")}


@pytest.mark.parametrize("mode,setting", [("tree", "greedy"), ("chain", "greedy"),
                                          ("tree", "qwen_vl")])
def test_tiny_vl_batch_of_images_identical(tiny_qwen2_vl, vl_batch, vl_reference, mode,
                                           setting, monkeypatch):
    from vllm_recap.core.drafter import Drafter

    proposed = []
    original = Drafter.propose

    def recording(self, req_id, node_budget=None, max_depth=None):
        tree = original(self, req_id, node_budget, max_depth)
        proposed.extend(tree.draft_tokens.tolist())
        return tree

    monkeypatch.setattr(Drafter, "propose", recording)
    spec = SPECS[mode]
    with make_llm(tiny_qwen2_vl, limit_mm_per_prompt={"image": 1, "video": 0},
                  speculative_config=spec) as llm:
        assert generate_ids(llm, vl_batch[0], _vl_params(setting)) == vl_reference[setting]
        proposer = recap_proposer(llm)
        assert set(vl_batch[1]) <= set(proposer.blocked)
        trees = proposer.stats["tree_requests"]
    assert (trees > 0) if mode == "tree" else (trees == 0), f"{trees} tree verifications"
    assert proposed, "RECAP proposed nothing"
    assert not set(proposed) & set(vl_batch[1]), "an image placeholder token was drafted"


@pytest.fixture(scope="module")
def spec_bench_prompts_smollm2(smollm2):
    from transformers import AutoTokenizer

    from benchmarks.workloads import spec_bench_prompts

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = spec_bench_prompts(tok, 2, max_prompt_tokens=700)
    assert len(prompts) >= 20 and len({p.category for p in prompts}) >= 10
    return [p.token_ids for p in prompts]


@pytest.fixture(scope="module")
def smollm2_reference(smollm2, spec_bench_prompts_smollm2):
    with make_llm(smollm2) as llm:
        return generate_ids(llm, spec_bench_prompts_smollm2, _params(48))


@pytest.mark.parametrize("mode", MODES)
def test_smollm2_spec_bench_identical(smollm2, spec_bench_prompts_smollm2, smollm2_reference, mode):
    with make_llm(smollm2, speculative_config=SPECS[mode]) as llm:
        out = generate_ids(llm, spec_bench_prompts_smollm2, _params(48))
        counters = spec_counters(llm)
        stats = recap_proposer(llm).stats
    mismatched = [i for i, (a, b) in enumerate(zip(out, smollm2_reference)) if a != b]
    assert not mismatched, f"outputs differ for prompts {mismatched}"
    assert counters["accepted_tokens"] > 0
    if mode == "tree":  # prompt seeding asked for (SPECS)
        assert stats["seeded_rows"] > 0
        assert stats["seeded_rows_fused"] > 0  # prompt rows rode along with the step's LM head
    else:  # the CPU default: no prompt rows
        assert stats["seeded_rows"] == 0
    assert (stats["tree_requests"] > 0) if mode == "tree" else (stats["tree_requests"] == 0)
