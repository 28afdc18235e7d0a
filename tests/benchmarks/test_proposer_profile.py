"""benchmarks.proposer_profile runs an engine and times RECAP's pieces per step."""
from __future__ import annotations

import json

import pytest

from benchmarks import proposer_profile

pytestmark = pytest.mark.engine


def test_profile_prints_step_work_and_the_timed_pieces(capsys, tmp_path):
    proposer_profile.main(["--prompts", "2", "--max-new-tokens", "8", "--concurrency", "2",
                           "--out", str(tmp_path / "profile.json")])
    out = capsys.readouterr().out
    assert "RECAP work per step: p50" in out
    assert "without prompt seeding: p50" in out and "that seeded prompt rows:" in out
    # the pieces every decode step runs were timed, with calls counted
    for name in ("_advance", "topk_rows", "drafter.observe", "node_tokens_of_rows"):
        line = next(x for x in out.splitlines() if x.strip().startswith(name + " "))
        assert int(line.split("calls")[1].split()[0]) > 0, line
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["steps"] > 0 and saved["work_ms"]["p50"] > 0 and saved["model"] == "smollm2"
    from benchmarks.machine import resolve_dtype

    assert saved["dtype"] == resolve_dtype("auto")  # the CPU's dtype, as benchmarks.run
    assert saved["pieces"]["_advance"]["calls"] > 0
    # seeding is part of the work, so the work without it is no larger
    assert 0 < saved["work_without_seeding_ms"]["mean"] <= saved["work_ms"]["mean"]
    assert 0 <= saved["p99_steps"]["seeded"] <= saved["p99_steps"]["steps"] > 0
    # what the slow steps spent: every decode step advances its requests, and no piece of
    # them took longer than the slowest step's whole work
    slow = saved["p99_steps"]["pieces_ms"]
    assert slow["_advance"] > 0 and max(slow.values()) <= max(saved["work_ms"].values())
    assert "their largest pieces, ms per step:" in out
    # both prompts ran in one batch: a decode step advances two requests
    assert saved["concurrency"] == 2
    assert saved["pieces"]["_advance"]["calls"] > 1.5 * saved["steps"] - 4


def test_again_times_the_pure_pieces_a_second_time(capsys):
    proposer_profile.main(["--prompts", "1", "--max-new-tokens", "8", "--again"])
    out = capsys.readouterr().out
    for name in proposer_profile.PURE:
        if name == "tree_output":  # only steps where every request verifies a tree
            continue
        first = next(x for x in out.splitlines() if x.strip().startswith(name + " "))
        again = next(x for x in out.splitlines() if x.strip().startswith(name + " again "))
        calls = [int(line.split("calls")[1].split()[0]) for line in (first, again)]
        assert calls[0] == calls[1] > 0, (first, again)


def test_sampled_requests_get_the_seeds_benchmarks_run_gives_them():
    from benchmarks.sampling import request_seed

    ids = ["sb81", "sb82"]
    seeded = proposer_profile.request_params("qwen_text", 0, ids, 16)
    assert [p.seed for p in seeded] == [request_seed(0, i) for i in ids]
    assert seeded[0].seed != seeded[1].seed and seeded[0].temperature == 0.7
    assert all(p.max_tokens == 16 and p.ignore_eos for p in seeded)
    assert [p.seed for p in proposer_profile.request_params("qwen_text", -1, ids, 16)] == [None] * 2
    assert [p.seed for p in proposer_profile.request_params("greedy", 0, ids, 16)] == [None] * 2


def test_a_seeded_sampled_profile_says_so(capsys, tmp_path):
    proposer_profile.main(["--prompts", "1", "--max-new-tokens", "8", "--sampling", "qwen_text",
                           "--out", str(tmp_path / "profile.json")])
    assert "sampling qwen_text (seeded)" in capsys.readouterr().out
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["seeded"] is True and saved["steps"] > 0


def test_layers_times_tree_and_stock_attention_layers(capsys, tmp_path):
    from vllm_recap.vllm.cpu_backend import RecapCPUAttentionImpl

    forward = RecapCPUAttentionImpl.forward
    proposer_profile.main(["--prompts", "2", "--max-new-tokens", "24", "--layers", "--spec",
                           '{"method": "recap", "budget_policy": "fixed", "node_budget": 4}',
                           "--out", str(tmp_path / "profile.json")])
    out = capsys.readouterr().out
    assert "attention layer calls, tree step against stock" in out
    assert RecapCPUAttentionImpl.forward is forward  # restored
    saved = json.loads((tmp_path / "profile.json").read_text())
    # every layer call of the measured steps timed: prefill and plain ones on vLLM's path,
    # those of steps with a (fixed, 4-node) tree on RECAP's
    calls = saved["attention_layer_calls"]
    assert calls["tree"] > 0 and calls["stock"] > 0 and calls["tree"] % 30 == 0  # 30 layers
    for row in saved["attention_layers"]:
        assert row["tree_calls"] >= 30 and row["stock_calls"] >= 30
        assert row["ratio"] == row["tree_p50_us"] / row["stock_p50_us"] > 0


def test_slow_step_pieces_books_each_call_to_its_step():
    times = {"a": [1.0, 2.0, 4.0], "b": [8.0, 16.0], "c": [32.0]}
    steps = {"a": [0, 1, 1], "b": [0, 2], "c": [0]}
    # steps 1 and 2: a spent 6 s, b 16 s, c nothing (left out)
    assert proposer_profile.slow_step_pieces(times, steps, {1, 2}) == {"b": 8.0, "a": 3.0}
    assert proposer_profile.slow_step_pieces(times, steps, set()) == {}


def test_layer_table_pairs_row_counts_timed_on_both_paths():
    times = {"tree": {5: [2e-6] * 30, 9: [1e-6] * 40}, "stock": {5: [1e-6] * 31, 9: [1e-6] * 3}}
    assert proposer_profile.layer_table(times) == [
        {"rows": 5, "tree_calls": 30, "tree_p50_us": 2.0, "stock_calls": 31,
         "stock_p50_us": 1.0, "ratio": 2.0}]
