"""Smoke-runs the benchmark entry point end to end at a tiny size, so it cannot rot.

One run of ``python -m benchmarks.run`` (its own process, as users run it) on the tiny random
Qwen2 and Qwen2.5-VL: every workload, concurrency 1 and 2, one ablation, 8 new tokens,
float32 (where any difference from no speculation is a bug), plus one sampled setting,
``t1`` (seeded), for recap-tree and its ``none``: the cheapest to sample, since vLLM's CPU
top-k/top-p and penalty ops cost more per step than the tiny model over its 151k-token
vocabulary. ~13 engine starts, ~2 minutes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_result(tiny_qwen2, tiny_qwen2_vl, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "benchmarks.run", "--model", tiny_qwen2, "--dtype", "float32",
           "--methods", "none,ngram,recap-tree", "--workloads", "spec_bench,two_turn,multimodal",
           "--categories", "qa,translation", "--per-category", "1", "--max-new-tokens", "8",
           "--ignore-eos", "--concurrency", "1,2", "--load-methods", "recap-tree",
           "--ablations", "abl-fusion-uniform", "--two-turn-methods", "recap-tree",
           "--two-turn-categories", "writing", "--mm-methods", "recap-tree", "--mm-prompts", "1",
           "--mm-model", tiny_qwen2_vl, "--kv-cache-mib", "128",
           "--sampling", "greedy,t1", "--sampling-methods", "recap-tree", "--out", str(out)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads((out / "result.json").read_text()), proc.stdout


def _requests(result: dict, method: str) -> list[dict]:
    """The batch-1 Spec-Bench records of ``method``."""
    return [r for j in result["jobs"] if j["method"] == method and j["phase"] == "spec_bench"
            and j["concurrency"] == 1 for r in j.get("requests", [])]


def test_outputs_exist(run_result):
    out, result, stdout = run_result
    for name in ("result.json", "summary.md", "speedup_by_category.png",
                 "throughput_vs_concurrency.png", "acceptance_histogram.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "summary.md").read_text() in stdout
    assert result["dtype"] == "float32" and result["machine"]["cpus"] >= 1
    assert {"vllm", "torch"} <= {k for k, v in result["machine"]["libraries"].items() if v}
    assert result["suffix"]["line"]
    assert not [j["name"] for j in result["jobs"] if j.get("error")], \
        [j["error"] for j in result["jobs"] if j.get("error")]


def test_batch1_tables(run_result):
    _, result, _ = run_result
    s = result["summary"]
    overall = {r["method"]: r for r in s["overall"]}
    assert list(overall) == ["none", "ngram", "recap-tree"]
    for name in ("ngram", "recap-tree"):
        row = overall[name]
        assert row["identical"] == row["compared"] == 2, row  # float32: lossless
        assert row["speedup_geomean"] > 0 and row["proposer_p50_us"] > 0 and row["peak_rss_mb"] > 0
        assert 0 < row["ttft_p50_ms"] < 1000 * max(r["seconds"] for r in _requests(result, name))
    assert overall["recap-tree"]["proposer_kind"] == "recap" and overall["recap-tree"]["u_bytes"] > 0
    assert {(r["category"], r["method"]) for r in s["per_category"]} == {
        (c, m) for c in ("qa", "translation") for m in overall}
    text = Path(result["plots"][0]).parent.joinpath("summary.md").read_text()
    for heading in ("## Spec-Bench, batch 1", "### Per category", "## Load", "## Two-turn",
                    "## Ablations", "## Multimodal", "## Proposer cost"):
        assert heading in text


def test_load_two_turn_ablation_and_multimodal_tables(run_result):
    _, result, _ = run_result
    s = result["summary"]
    load = {(r["method"], r["concurrency"]): r for r in s["load"]}
    assert set(load) == {("none", 1), ("ngram", 1), ("recap-tree", 1), ("none", 2), ("recap-tree", 2)}
    assert load[("recap-tree", 2)]["max_in_flight"] == 2 and load[("recap-tree", 2)]["vs_none"] > 0
    assert load[("recap-tree", 2)]["identical"] == 2
    assert 0 < load[("recap-tree", 2)]["ttft_p50_s"] <= load[("recap-tree", 2)]["ttft_p99_s"]
    turns = {(r["method"], r["turn"]): r for r in s["two_turn"]}
    assert set(turns) == {(m, t) for m in ("none", "recap-tree") for t in (1, 2)}
    assert turns[("recap-tree", 2)]["identical"] == 1
    abl = [r["method"] for r in s["ablations"]]
    assert abl == ["recap-tree-b16", "abl-fusion-uniform"]
    assert s["ablations"][1]["identical"] == 2 and s["ablations"][1]["full_vs_variant_tps"] is not None
    mm = {r["method"]: r for r in s["multimodal"]}
    assert set(mm) == {"none", "recap-tree"} and mm["recap-tree"]["identical"] == 1


def test_sampled_setting(run_result):
    out, result, _ = run_result
    jobs = {j["name"]: j for j in result["jobs"]}
    assert {"none/spec_bench/t1/c1/r0", "recap-tree/spec_bench/t1/c1/r0"} <= set(jobs)
    assert jobs["recap-tree/spec_bench/t1/c1/r0"]["sampling"] == "t1"
    assert jobs["recap-tree/spec_bench/c1/r0"]["sampling"] == "greedy"
    sent = json.loads((out / "jobs" / "recap-tree_spec_bench_t1_c1_r0.job.json").read_text())
    assert sent["sampling"] == {"name": "t1", "params": {"temperature": 1.0}, "seed": 0}
    sections = {sec["name"]: sec for sec in result["summary"]["sampling"]}
    assert list(sections) == ["greedy", "t1"] and sections["t1"]["seeded"]
    rows = {r["method"]: r for r in sections["t1"]["rows"]}
    assert list(rows) == ["none", "recap-tree"]
    tree = rows["recap-tree"]
    # a float32 run: RECAP's seeded sampled outputs are checked against none's, and equal
    assert tree.get("identity") != "n/a" and tree["identical"] == tree["compared"] == 2
    assert tree["output_tokens"] == 16 and tree["speedup_geomean"] > 0
    assert tree["tree_request_share"] is not None and tree["tree_pass_share"] is not None
    assert "tree_steps" in jobs["recap-tree/spec_bench/t1/c1/r0"]["requests"][0]
    text = (out / "summary.md").read_text()
    assert "## Sampling settings" in text and "### Sampling `t1`" in text
