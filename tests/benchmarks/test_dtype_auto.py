"""``--dtype auto`` means one thing in every benchmark: bfloat16 where the CPU multiplies bf16
natively (AVX-512 BF16), float32 elsewhere (:func:`benchmarks.machine.resolve_dtype`).

vLLM's own ``auto`` loads a bf16 checkpoint in bf16 on any x86 CPU; on an AVX2-only one that
runs emulated, about linearly in a pass's tokens, and an interleaved run there compared
methods on a ~14 tokens/s engine where no speculation can pay (AMD EPYC, AVX2, 2026-12-07).
"""
from __future__ import annotations

import pytest
import torch

from benchmarks import interleave

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("native, expected", [(False, "float32"), (True, "bfloat16")])
def test_interleave_resolves_auto_as_benchmarks_run(monkeypatch, tmp_path, native, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    assert interleave.parse_args(["--out", str(tmp_path)]).dtype == expected
    # an explicit dtype is passed through as given
    assert interleave.parse_args(["--out", str(tmp_path), "--dtype", "float16"]).dtype == "float16"


def test_interleave_child_keeps_its_spec_dtype(tmp_path):
    # a child reads the dtype from its spec file; its arguments are not resolved (it imports
    # vLLM and vllm_recap only)
    args = interleave.parse_args(["--child", str(tmp_path / "spec.json"), "--out", str(tmp_path)])
    assert args.dtype == "auto"
