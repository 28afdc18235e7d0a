"""The environment is real: vLLM runs the tiny and embedded models and agrees with HF."""
from __future__ import annotations

import pytest

from tests.conftest import make_llm
from tests.images import make_image

pytestmark = pytest.mark.engine

NEW_TOKENS = 20


def _hf_greedy(model_dir: str, **inputs) -> list[int]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoModelForCausalLM

    cls = AutoModelForImageTextToText if "pixel_values" in inputs else AutoModelForCausalLM
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_tiny_qwen2_matches_hf(tiny_qwen2):
    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    ids = AutoTokenizer.from_pretrained(tiny_qwen2)("The quick brown fox jumps over")["input_ids"]
    expected = _hf_greedy(tiny_qwen2, input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    with make_llm(tiny_qwen2) as llm:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    got = list(out[0].outputs[0].token_ids)
    assert len(set(got)) > 3, "the tiny model must not emit one token forever"
    assert got == expected


def test_tiny_qwen2_vl_with_image_matches_hf(tiny_qwen2_vl):
    from transformers import AutoProcessor
    from vllm import SamplingParams

    processor = AutoProcessor.from_pretrained(tiny_qwen2_vl)
    image = make_image(1)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this picture."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (inputs["input_ids"] == image_token).sum() >= 4, "the image must reach the model as tokens"
    expected = _hf_greedy(tiny_qwen2_vl, **inputs)
    with make_llm(tiny_qwen2_vl, limit_mm_per_prompt={"image": 1, "video": 0}) as llm:
        out = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert list(out[0].prompt_token_ids) == inputs["input_ids"][0].tolist()
    assert list(out[0].outputs[0].token_ids) == expected


def test_ngram_on_smollm2_is_lossless_and_reports_metrics(smollm2):
    from transformers import AutoTokenizer
    from vllm import SamplingParams, TokensPrompt

    from benchmarks.harness import spec_counters
    from benchmarks.methods import NGRAM
    from benchmarks.workloads import spec_bench_prompts

    tok = AutoTokenizer.from_pretrained(smollm2)
    prompts = spec_bench_prompts(tok, 1, ["summarization", "rag", "qa", "translation", "coding"],
                                 max_prompt_tokens=900)
    assert len(prompts) == 5
    params = SamplingParams(temperature=0, max_tokens=48)
    batch = [TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts]
    with make_llm(smollm2) as llm:
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]
    with make_llm(smollm2, speculative_config=NGRAM) as llm:
        spec = [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]
        counters = spec_counters(llm)
    assert spec == plain
    assert counters["drafts"] > 0 and counters["draft_tokens"] >= counters["drafts"]
    assert 0 < counters["accepted_tokens"] <= counters["draft_tokens"]


def test_smollm2_cache_hit_does_not_convert(smollm2, monkeypatch):
    from vllm_recap.models import gguf

    monkeypatch.setattr(gguf, "convert_gguf", lambda *a, **k: pytest.fail("converted a second time"))
    assert str(gguf.smollm2_path()) == smollm2
