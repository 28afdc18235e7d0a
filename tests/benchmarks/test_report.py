"""Pure parts of the benchmark suite: speedup math, histograms, the closed loop, method
registry, report tables (no engine)."""
from __future__ import annotations

import math

import pytest

from benchmarks import markdown, report
from benchmarks.load import closed_loop
from benchmarks.methods import ABLATION_REFERENCE, ABLATIONS, GROUPS, METHODS, expand, method_config

pytestmark = pytest.mark.unit


def _rec(pid, n_tokens, seconds, cat="qa", **kw):
    return {"prompt_id": pid, "category": cat, "output_ids": list(range(n_tokens)),
            "seconds": seconds, **kw}


# -- speedups -------------------------------------------------------------------------------

def test_paired_speedups_are_per_prompt_ratios_of_tokens_per_second():
    base = {"a": _rec("a", 10, 2.0), "b": _rec("b", 10, 1.0), "c": _rec("c", 0, 1.0)}
    meth = {"a": _rec("a", 10, 1.0), "b": _rec("b", 5, 1.0), "c": _rec("c", 4, 1.0),
            "d": _rec("d", 10, 1.0)}
    # a: 10/s vs 5/s = 2; b: 5/s vs 10/s = 0.5; c: baseline produced nothing; d: no baseline
    assert report.paired_speedups(meth, base) == [2.0, 0.5]
    stats = report.speedup_stats([2.0, 0.5])
    assert stats["speedup_mean"] == 1.25
    assert stats["speedup_geomean"] == pytest.approx(1.0)
    assert stats["speedup_median"] == 1.25 and stats["speedup_min"] == 0.5 and stats["speedup_max"] == 2.0
    assert report.speedup_stats([])["speedup_geomean"] is None


def test_prompt_figures_acceptance_tokens_per_pass_and_identity():
    base = {"a": _rec("a", 12, 2.0), "b": _rec("b", 12, 2.0)}
    meth = {"a": _rec("a", 12, 1.0, drafts=4, draft_tokens=20, accepted_tokens=6),
            "b": {**_rec("b", 12, 1.0, drafts=0, draft_tokens=0, accepted_tokens=0),
                  "output_ids": list(range(5)) + [99] + list(range(6, 12))}}
    fig = report.prompt_figures(meth, base)
    assert fig["output_tokens"] == 24 and fig["tokens_per_s"] == 12.0
    assert fig["acceptance_length"] == 1 + 6 / 4  # vLLM's figure: drafted steps only
    assert fig["tokens_per_pass"] == 24 / (24 - 6)  # every pass commits 1 + accepted
    assert fig["draft_tokens_per_step"] == 5.0 and fig["draft_rate"] == 4 / 18
    assert fig["identical"] == 1 and fig["compared"] == 2 and fig["first_differences"] == {"b": 5}
    assert fig["speedup_geomean"] == pytest.approx(2.0)


def test_first_difference():
    assert report.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert report.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert report.first_difference([1, 2], [1, 2, 3]) == 2


def test_merge_requests_takes_the_median_seconds_and_mean_counters_over_repeats():
    jobs = [{"requests": [_rec("a", 4, s, drafts=d, draft_tokens=d, accepted_tokens=d)]}
            for s, d in ((1.0, 2), (3.0, 4), (2.0, 6))]
    jobs[2]["requests"][0]["output_ids"] = [9, 9, 9, 9]
    merged = report.merge_requests(jobs)["a"]
    assert merged["seconds"] == 2.0 and merged["seconds_all"] == [1.0, 3.0, 2.0]
    assert merged["drafts"] == 4.0 and merged["consistent"] is False


# -- acceptance histogram from vLLM's per-position counters ---------------------------------

def test_accepted_histogram_from_per_position_counts():
    # 10 drafted steps; accepted >= 1 in 6, >= 2 in 3, >= 3 in 1 (of 4 positions)
    assert report.accepted_histogram([6, 3, 1, 0], 10) == [4, 3, 2, 1, 0]
    assert sum(report.accepted_histogram([6, 3, 1, 0], 10)) == 10
    assert report.accepted_histogram([], 5) == [5]
    with pytest.raises(ValueError, match="non-increasing"):
        report.accepted_histogram([3, 5], 10)


def test_accepted_histogram_matches_counter_semantics():
    """Simulate vLLM's SpecDecodingStats.observe_draft and recover the exact distribution."""
    accepted = [0, 2, 2, 5, 1, 0, 3]
    per_pos = [0] * 5
    for a in accepted:
        for i in range(a):
            per_pos[i] += 1
    hist = report.accepted_histogram(per_pos, len(accepted))
    assert hist == [accepted.count(k) for k in range(6)]


def test_percentile():
    assert report.percentile([], 50) is None
    assert report.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert report.percentile([0.0, 10.0], 99) == pytest.approx(9.9)


# -- closed loop ----------------------------------------------------------------------------

class FakeEngine:
    """Each request needs ``work[i]`` steps; a step advances every request in flight."""

    def __init__(self, work: list[int]) -> None:
        self.work, self.left, self.ids, self.now = work, {}, 0, 0.0
        self.batch_sizes: list[int] = []

    def submit(self, i: int) -> str:
        rid = f"r{self.ids}"
        self.ids += 1
        self.left[rid] = (i, self.work[i])
        return rid

    def step(self):
        self.now += 1.0
        self.batch_sizes.append(len(self.left))
        done = []
        for rid, (i, n) in list(self.left.items()):
            if n <= 1:
                done.append((rid, [i] * self.work[i]))
                del self.left[rid]
            else:
                self.left[rid] = (i, n - 1)
        return done


def test_closed_loop_keeps_concurrency_requests_in_flight_and_refills():
    eng = FakeEngine([3, 1, 2, 2, 1])
    finished, stats = closed_loop(5, 2, eng.submit, eng.step, clock=lambda: eng.now)
    assert [f.index for f in finished] == [0, 1, 2, 3, 4]
    assert [f.output_ids for f in finished] == [[0] * 3, [1], [2] * 2, [3] * 2, [4]]
    assert max(eng.batch_sizes) == 2 == stats.max_in_flight
    # 0 and 1 start at t=0; 1 ends at t=1 and 2 starts; 0 ends t=3, 2 ends t=3; 3, 4 start at 3
    assert [(f.start, f.end) for f in finished] == [(0, 3), (0, 1), (1, 3), (3, 5), (3, 4)]
    assert stats.steps == 5 and stats.wall_s == 5.0
    assert stats.mean_in_flight == sum(eng.batch_sizes) / 5


def test_closed_loop_at_concurrency_one_is_sequential_and_calls_hooks_outside_requests():
    eng = FakeEngine([2, 3])
    calls = []
    finished, stats = closed_loop(
        2, 1, eng.submit, eng.step, clock=lambda: eng.now,
        before_submit=lambda i: calls.append(("submit", i, len(eng.left))),
        after_finish=lambda f: calls.append(("done", f.index, len(eng.left))))
    assert calls == [("submit", 0, 0), ("done", 0, 0), ("submit", 1, 0), ("done", 1, 0)]
    assert [f.latency for f in finished] == [2.0, 3.0] and stats.max_in_flight == 1


def test_closed_loop_rejects_unknown_request_ids_and_bad_concurrency():
    with pytest.raises(RuntimeError, match="not in flight"):
        closed_loop(1, 1, lambda i: "x", lambda: [("y", [1])])
    with pytest.raises(ValueError, match="concurrency"):
        closed_loop(1, 0, lambda i: "x", lambda: [])


# -- methods --------------------------------------------------------------------------------

def test_method_registry_groups_and_configs():
    assert GROUPS["core"] == ["none", "ngram", "suffix", "token-recycling", "recap-chain", "recap-tree"]
    assert expand("core,recap-tree,budgets")[:6] == GROUPS["core"]
    assert "recap-tree-b32" in expand("budgets")
    assert method_config("recap-tree-b8") == {"method": "recap", "budget_policy": "fixed", "node_budget": 8}
    assert method_config("none") is None
    with pytest.raises(ValueError, match="known methods"):
        expand("none,bogus")
    for abl in ABLATIONS:  # equal fixed budget: differ from the reference only in their knob
        cfg, ref = method_config(abl.method), method_config(ABLATION_REFERENCE)
        assert {k: v for k, v in cfg.items() if k not in abl.knob} == ref


def test_every_recap_method_config_is_valid():
    from vllm_recap.vllm.options import translate

    for name, m in METHODS.items():
        if m.config is not None and m.config["method"] == "recap":
            translate(m.config)  # raises on an unknown knob or a bad value


# -- report tables --------------------------------------------------------------------------

def _job(method, phase="spec_bench", c=1, requests=(), **kw):
    return {"name": f"{method}/{phase}/c{c}/r0", "method": method, "phase": phase,
            "concurrency": c, "repeat": 0, "requests": list(requests),
            "counters": {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": [],
                         "preemptions": 0}, "peak_rss_mb": 100.0, **kw}


def test_build_summary_and_markdown_with_a_crashed_method_and_a_slow_load():
    results = [
        _job("none", requests=[_rec("a", 10, 1.0, "qa"), _rec("b", 10, 1.0, "rag")]),
        _job("recap-tree", requests=[_rec("a", 10, 0.5, "qa", drafts=5, draft_tokens=10, accepted_tokens=5),
                                     _rec("b", 10, 1.0, "rag", drafts=5, draft_tokens=10, accepted_tokens=5)],
             counters={"drafts": 10, "draft_tokens": 20, "accepted_tokens": 10,
                       "accepted_per_pos": [6, 3, 1], "preemptions": 0},
             proposer={"kind": "recap", "step_us": {"n": 3, "p50": 10.0, "p99": 30.0},
                       "tree": {"mean_nodes": 2.0, "per_depth_acceptance": [0.6, 0.3]},
                       "memory_peak": {"u_bytes": 2048, "context_rows": 7, "context_bytes": 1024,
                                       "requests": 1}}),
        _job("ngram", requests=[], error="Traceback ...\nRuntimeError: boom"),
        _job("none", c=4, requests=[_rec("a", 10, 1.0), _rec("b", 10, 1.0)], loop={"wall_s": 1.0, "max_in_flight": 2}),
        _job("recap-tree", c=4, requests=[_rec("a", 10, 1.0), _rec("b", 10, 1.0)], loop={"wall_s": 2.0, "max_in_flight": 2},
             foreign_cpu=0.4, load_average_start=[1.0], load_average_end=[2.0]),
    ]
    s = report.build_summary(results, ["none", "recap-tree", "ngram"], [1, 4], [], [])
    overall = {r["method"]: r for r in s["overall"]}
    assert overall["recap-tree"]["speedup_geomean"] == pytest.approx(math.sqrt(2.0))
    assert overall["recap-tree"]["identical"] == 2 and overall["recap-tree"]["acceptance_length"] == 2.0
    assert overall["recap-tree"]["accepted_histogram"] == [4, 3, 2, 1]
    assert overall["ngram"]["error"] == "RuntimeError: boom"
    assert {(r["category"], r["method"]) for r in s["per_category"]} == {
        ("qa", "none"), ("rag", "none"), ("qa", "recap-tree"), ("rag", "recap-tree")}
    load = {(r["method"], r["concurrency"]): r for r in s["load"]}
    assert load[("recap-tree", 4)]["vs_none"] == 0.5 and load[("recap-tree", 1)]["vs_none"] == pytest.approx(4 / 3)
    text = "\n".join(s["findings"])
    assert "ngram failed: RuntimeError: boom" in text
    assert "load c=4: recap-tree at 0.50x" in text and "slower than no speculation" in text
    assert "recap-tree/spec_bench/c4/r0: other processes used 40%" in text
    table = markdown.markdown_table(s["overall"], markdown.OVERALL)
    assert len(table.splitlines()) == 2 + 3 and "| recap-tree |" in table
    assert "| ngram | 0 |" in table and "0/0" not in table  # a crashed method compares nothing
    assert "1.41x" in markdown.speedup_pivot(s["per_category"], s["overall"])


def test_unknown_categories_are_named_with_the_known_ones():
    from benchmarks.workloads import load_spec_bench, two_turn_conversations

    assert len(load_spec_bench(per_category=1)) == 13
    with pytest.raises(ValueError, match=r"Unknown Spec-Bench categories \['nope'\]; the file has"):
        load_spec_bench(categories=["nope"])
    with pytest.raises(ValueError, match=r"Unknown two-turn categories \['qa'\]"):
        two_turn_conversations(None, 1, ["qa"])  # qa rows have one turn only
