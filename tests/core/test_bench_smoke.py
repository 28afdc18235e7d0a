"""Smoke-runs benchmarks/bench_core.py at a tiny size so the benchmark cannot rot."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_core.py"


def test_bench_core_quick(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_core", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--quick", "--out-dir", str(tmp_path)])
    saved = json.loads((tmp_path / "core_speed.json").read_text())
    assert saved == json.loads(json.dumps(result))
    case = saved["cases"][0]
    assert case["samples"] > 0 and case["step_us"]["p50"] > 0 and case["mean_drafts"] > 0
    assert {"date", "platform", "cpu_count"} <= set(saved["meta"])
    assert "| budget | batch |" in (tmp_path / "core_speed.md").read_text()


def test_bench_core_takes_config_knobs(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_core", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--quick", "--out-dir", str(tmp_path), "--knobs",
                          '{"suffix_mode": "earliest", "shared_index": "off"}'])
    assert result["meta"]["knobs"] == {"suffix_mode": "earliest", "shared_index": "off"}
    assert "earliest" in (tmp_path / "core_speed.md").read_text()
