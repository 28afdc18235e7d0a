"""``benchmarks.step_breakdown``: step kinds, per-kind wall time and the within-run drafted /
idle ratio, on hand-made step records (no engine)."""
from __future__ import annotations

import pytest

from benchmarks import step_breakdown as sb

pytestmark = pytest.mark.unit


def _recap_run() -> list[dict]:
    """A RECAP run at concurrency 2: one arrival step, drafted / declined / idle decode steps
    (one of them with a single request left), and the end marker."""
    t, steps = 0.0, []
    for seconds, step in [
        (0.10, {"reqs": 2, "arrivals": 2, "drafts": 0, "idle": False, "committed": 2}),
        (0.04, {"reqs": 2, "arrivals": 0, "drafts": 6, "idle": False, "committed": 6}),
        (0.04, {"reqs": 2, "arrivals": 0, "drafts": 4, "idle": False, "committed": 4}),
        (0.03, {"reqs": 2, "arrivals": 0, "drafts": 0, "idle": False, "committed": 2}),
        (0.02, {"reqs": 2, "arrivals": 0, "drafts": 0, "idle": True, "committed": 2}),
        (0.02, {"reqs": 2, "arrivals": 0, "drafts": 0, "idle": True, "committed": 2}),
        (0.01, {"reqs": 1, "arrivals": 0, "drafts": 0, "idle": True, "committed": 1}),
    ]:
        steps.append({"t": t, **step})
        t += seconds
    return steps + [{"t": t}]


def test_kinds():
    assert sb.kind({"arrivals": 1, "drafts": 3, "idle": False}) == "arrival"
    assert sb.kind({"arrivals": 0, "drafts": 3, "idle": False}) == "drafted"
    assert sb.kind({"arrivals": 0, "drafts": 0, "idle": False}) == "declined"
    assert sb.kind({"arrivals": 0, "drafts": 0, "idle": True}) == "idle"
    assert sb.kind({"arrivals": 0, "reqs": 4}) == "decode"  # no RECAP records


def test_run_kinds_times_each_step_to_the_next_one():
    kinds = sb.run_kinds(_recap_run())
    assert kinds["arrival"]["steps"] == 1
    assert kinds["arrival"]["seconds"] == pytest.approx(0.10)
    assert kinds["drafted"]["steps"] == 2 and kinds["drafted"]["committed"] == 10
    assert kinds["drafted"]["seconds"] == pytest.approx(0.08)
    assert kinds["declined"]["steps"] == 1
    # the step with one request left is idle but not full-batch
    assert kinds["idle"]["steps"] == 3 and kinds["idle"]["full_steps"] == 2
    assert kinds["idle"]["full_committed"] == 4
    assert kinds["idle"]["full_seconds"] == pytest.approx(0.04)


def test_drafted_over_idle_compares_full_batch_steps_of_one_run():
    # drafted 10 tokens in 0.08 s (125/s), idle 4 tokens in 0.04 s (100/s)
    assert sb.drafted_over_idle(sb.run_kinds(_recap_run())) == pytest.approx(1.25)
    no_idle = [s for s in _recap_run() if not s.get("idle")]
    assert sb.drafted_over_idle(sb.run_kinds(no_idle)) is None


def test_engines_without_recap_records_have_decode_steps_and_no_token_counts():
    steps = [{"t": 0.0, "reqs": 2, "arrivals": 2}, {"t": 0.1, "reqs": 2, "arrivals": 0},
             {"t": 0.12, "reqs": 2, "arrivals": 0}, {"t": 0.14}]
    kinds = sb.run_kinds(steps)
    assert set(kinds) == {"arrival", "decode"}
    assert kinds["decode"]["steps"] == 2 and kinds["decode"]["committed"] is None


def test_drain_seconds_count_the_steps_after_the_last_arrival():
    assert sb.drain_seconds(_recap_run()) == pytest.approx(0.16)
    late = _recap_run()
    late[3]["arrivals"] = 1  # a request arrives in the fourth step: three steps drain
    assert sb.drain_seconds(late) == pytest.approx(0.05)


def test_breakdown_and_markdown():
    runs = [{"engine": "recap-tree", "round": r, "wall_s": 0.26, "steps": _recap_run(),
             "drafting": {"drafts": 4, "draft_tokens": 10, "accepted_tokens": 3 + r}}
            for r in range(2)]
    runs.append({"engine": "none", "round": 0, "wall_s": 0.3, "tokens_per_s": 10.0})
    rows = sb.breakdown(runs, ["none", "recap-tree"])
    assert [r["engine"] for r in rows] == ["recap-tree"]  # none recorded no steps
    (row,) = rows
    shares = {k["kind"]: k["wall_share"] for k in row["kinds"]}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["arrival"] == pytest.approx(0.10 / 0.26)
    drafted = next(k for k in row["kinds"] if k["kind"] == "drafted")
    assert drafted["tokens_per_step"] == pytest.approx(5.0)
    assert drafted["ms_per_step"] == pytest.approx(40.0)
    assert row["drafted_over_idle"] == [1.25, 1.25]
    assert row["drain_s"] == [0.16, 0.16]
    text = sb.markdown(rows)
    assert "| recap-tree | drafted | 2 | 31% | 40.0 | 5.00 |" in text
    assert "1.25, 1.25 (median 1.25)" in text
    assert row["drafting"] == {"draft_tokens_per_run": 10.0, "accepted_per_draft_token": 0.35,
                               "draft_tokens_per_draft": 2.5}
    assert "| recap-tree | 10 | 0.350 | 2.50 |" in text
    assert sb.drafting([None, {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}]) is None
    assert sb.markdown([]) == ""


def test_decode_ratios_leave_the_arrival_steps_out():
    """The same round's `none` over the engine, decode-phase seconds only: a slow prefill
    burst in one engine's run moves its tokens/s, not this ratio."""
    recap = _recap_run()  # arrival 0.10 s, decode 0.16 s
    none = [{"t": 0.0, "reqs": 2, "arrivals": 2}, {"t": 0.5, "reqs": 2, "arrivals": 0},
            {"t": 0.6, "reqs": 2, "arrivals": 0}, {"t": 0.7}]  # a slow arrival, decode 0.2 s
    assert sb.phase_seconds(none) == pytest.approx((0.5, 0.2))
    runs = [{"engine": "none", "round": 0, "wall_s": 0.7, "steps": none},
            {"engine": "recap-tree", "round": 0, "wall_s": 0.26, "steps": recap},
            {"engine": "recap-tree", "round": 1, "wall_s": 0.26, "steps": recap}]  # no none
    assert sb.decode_ratios(runs, "recap-tree") == [pytest.approx(0.2 / 0.16)]
    rows = sb.breakdown(runs, ["none", "recap-tree"])
    assert rows[1]["decode_ratio"] == [1.25] and rows[1]["arrival_s"] == [0.1, 0.1]
    text = sb.markdown(rows)
    assert "| recap-tree | 1.25 (median 1.25) | 0.10, 0.10 |" in text
    assert "| none | 1.00 (median 1.00) | 0.50 |" in text
