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
    assert saved["pieces"]["_advance"]["calls"] > 0
    # seeding is part of the work, so the work without it is no larger
    assert 0 < saved["work_without_seeding_ms"]["mean"] <= saved["work_ms"]["mean"]
    assert 0 <= saved["p99_steps"]["seeded"] <= saved["p99_steps"]["steps"] > 0
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
