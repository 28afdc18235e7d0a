"""Smoke-runs benchmarks/gpu_tree_verify.py at its tiny CPU size so the GPU script cannot rot.

The GPU machines it is meant for have torch but neither vLLM nor numba, so the run imports the
script fresh with those (and the numba-based RECAP core) made unimportable.
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit


def test_gpu_tree_verify_small_with_torch_alone(tmp_path: Path, monkeypatch) -> None:
    loaded_vllm = [m for m in sys.modules if m.startswith("vllm.")]  # other tests may import it
    for name in ("vllm", "numba", "vllm_recap.core", *loaded_vllm):
        monkeypatch.setitem(sys.modules, name, None)
    for name in ("benchmarks.gpu_tree_verify", "vllm_recap.vllm.cuda_recompute",
                 "vllm_recap.vllm.attention_math", "vllm_recap.vllm.context"):
        if name in sys.modules:
            parent, _, child = name.rpartition(".")
            # restore the package attribute too, which the fresh import below rebinds
            monkeypatch.setattr(sys.modules[parent], child, sys.modules[name])
            monkeypatch.delitem(sys.modules, name)
    main = importlib.import_module("benchmarks.gpu_tree_verify").main

    result = main(["--small", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_tree_verify.json").read_text())
    assert saved == json.loads(json.dumps(result))
    failed = [c["name"] for c in saved["checks"] if c["passed"] is False]
    assert not failed, saved["checks"]
    ran = {c["name"] for c in saved["checks"] if c["passed"]}
    assert {"recompute_torch", "recompute_torch_window", "decoder_tree_vs_chain_fp32"} <= ran
    sizes = {(r["prefix"], r["tree_tokens"]) for r in saved["forward"]}
    assert sizes == {(p, k) for p in (32, 64) for k in (1, 4, 8)}
    assert all(r["median_ms"] > 0 and r["runs"] == 3 for r in saved["forward"])
    assert saved["overhead"] and saved["meta"]["shape_name"] == "small"
    assert "| prefix P | tree tokens k |" in (tmp_path / "gpu_tree_verify.md").read_text()
