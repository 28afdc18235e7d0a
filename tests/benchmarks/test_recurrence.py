"""benchmarks.recurrence: the counting rules, and the raw-logit processing against vLLM's own."""
from __future__ import annotations

import json

import pytest

from benchmarks import recurrence


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    assert recurrence.process({1: 10.0, 2: 9.0}, {1}, 1.2) == 2  # 10 / 1.2 < 9
    assert recurrence.process({1: -1.0, 2: -1.1}, {1}, 1.2) == 2  # -1.2 < -1.1
    assert recurrence.process({1: 10.0, 2: 9.0}, set(), 1.2) == 1
    assert recurrence.process({3: 5.0, 2: 5.0}, set(), 1.0) == 2  # ties: the lower id


def test_stored_rows_keep_their_own_history_and_reprocessed_rows_take_the_current_one():
    # prompt 5 7, output 9 5 7 8; the row after (5, 7) ranks 9 first until 9 is penalised
    rows = {1: {7: 4.0, 3: 1.0}, 2: {9: 10.0, 8: 9.0}, 3: {5: 3.0}, 4: {7: 3.0},
            5: {9: 10.0, 8: 9.0}}
    got = recurrence.count([5, 7], [9, 5, 7, 8], rows, penalty=2.0)
    assert got["positions"] == 4 and got["own_row_ok"] == 4
    # C = 1: (5) before position 4 recurs (prompt row 1, right either way); (7) before
    # position 5 recurs with row 2, stored under history {5, 7}: 9 first, wrong; re-processed
    # with {5, 7, 9}: 8 first, right
    assert (got["c1_recurring"], got["c1_stored"], got["c1_reprocessed"]) == (2, 1, 2)
    assert (got["c2_recurring"], got["c2_stored"], got["c2_reprocessed"]) == (1, 0, 1)
    assert got["c3_recurring"] == 0


def test_a_sampled_setting_is_refused():
    with pytest.raises(SystemExit, match="not greedy-equivalent"):
        recurrence.run_setting(None, [], "qwen_text", 8, 20)


@pytest.mark.engine
def test_raw_rows_reproduce_vllms_penalised_argmax(tmp_path, capsys):
    recurrence.main(["--settings", "qwen_vl", "--per-category", "1", "--max-new-tokens", "16",
                     "--dtype", "float32", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "result.json").read_text())
    shares = result["settings"]["qwen_vl"]["shares"]
    # every generated token is the penalised argmax of its own raw row (float32: no ties
    # here); this is what makes the stored / re-processed figures mean something
    assert shares["own_row_ok"] == 1.0
    assert result["settings"]["qwen_vl"]["counts"]["positions"] > 100
    assert "| qwen_vl |" in (tmp_path / "summary.md").read_text()
