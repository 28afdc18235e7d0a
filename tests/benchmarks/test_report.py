"""Pure parts of the benchmark suite: speedup math, histograms, the closed loop, method
registry, report tables (no engine)."""
from __future__ import annotations

import math

import numpy as np

import pytest

from benchmarks import markdown, report
from benchmarks.load import closed_loop
from benchmarks.methods import (
    ABLATION_REFERENCE,
    ABLATIONS,
    CONTINUATION_ABLATIONS,
    GROUPS,
    METHODS,
    expand,
    method_config,
)

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
    assert merged["ttft_s"] is None  # no repeat knew its first token's time


def test_time_to_first_token_is_the_median_over_repeats_and_a_percentile_over_prompts():
    """TTFT (vLLM's first_token_latency per request: prefill plus the first step, where
    prompt seeding's rows ride along) -- per prompt the median over repeats, then the
    batch-1 table's p50 in ms and the load table's p50 / p99 in seconds."""
    jobs = [_job("none", requests=[_rec("a", 4, 1.0, ttft_s=t), _rec("b", 4, 1.0, ttft_s=0.5)])
            for t in (0.1, None, 0.3)]
    merged = report.merge_requests(jobs)
    assert merged["a"]["ttft_s"] == pytest.approx(0.2) and merged["b"]["ttft_s"] == 0.5
    assert report.prompt_figures(merged, None)["ttft_p50_ms"] == pytest.approx(350.0)
    load = {(r["method"], r["concurrency"]): r
            for r in report.load_rows(jobs, ["none"], [1])}[("none", 1)]
    assert load["ttft_p50_s"] == pytest.approx(0.35)
    assert load["ttft_p99_s"] == pytest.approx(0.2 + 0.99 * 0.3)
    assert "TTFT p50 s" in markdown.markdown_table([load], markdown.LOAD)


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
    assert expand("continuations") == [a.method for a in CONTINUATION_ABLATIONS]
    for abl in ABLATIONS + CONTINUATION_ABLATIONS:  # equal fixed budget: differ from the reference only in their knob
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


# -- sampling settings ----------------------------------------------------------------------

def test_sampling_settings_parse_seed_and_job_data():
    from benchmarks.sampling import SAMPLINGS, job_sampling, parse_settings, request_seed

    assert parse_settings("greedy, qwen_vl,t1,greedy") == ["greedy", "qwen_vl", "t1"]
    with pytest.raises(ValueError, match="Unknown sampling setting 'hot'; known: greedy, qwen_vl"):
        parse_settings("greedy,hot")
    with pytest.raises(ValueError, match="no sampling setting"):
        parse_settings(" , ")
    assert SAMPLINGS["qwen_vl"].params == {"temperature": 0.1, "top_k": 1, "top_p": 0.001,
                                           "repetition_penalty": 1.05}
    assert SAMPLINGS["qwen_text"].params == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                             "repetition_penalty": 1.05}
    assert [n for n, s in SAMPLINGS.items() if s.deterministic] == ["greedy", "qwen_vl", "json"]
    # a request's seed depends on the base seed and the prompt only (same for every method)
    assert request_seed(0, "sb1") == request_seed(0, "sb1") != request_seed(0, "sb2")
    assert request_seed(1, "sb1") != request_seed(0, "sb1") and 0 <= request_seed(0, "sb1") < 2**31
    assert request_seed(None, "sb1") is None and request_seed(-1, "sb1") is None
    # deterministic settings are never seeded; a negative base seed drops the seeds
    assert job_sampling("greedy", 0) == {"name": "greedy", "params": {"temperature": 0.0}, "seed": None}
    assert job_sampling("qwen_vl", 0)["seed"] is None
    assert job_sampling("t1", 5) == {"name": "t1", "params": {"temperature": 1.0}, "seed": 5}
    assert job_sampling("qwen_text", -1)["seed"] is None


def test_sampling_params_of_a_job():
    from benchmarks.sampling import job_sampling, request_seed, sampling_params

    greedy = sampling_params(None, 16, True)
    assert greedy.temperature == 0.0 and greedy.max_tokens == 16 and greedy.ignore_eos and greedy.seed is None
    text = sampling_params(job_sampling("qwen_text", 3), 8, False, "sb7")
    assert (text.temperature, text.top_p, text.top_k, text.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert text.seed == request_seed(3, "sb7") and text.max_tokens == 8 and not text.ignore_eos
    assert sampling_params(job_sampling("qwen_text", 3), 8, False).seed is None  # no prompt: no seed
    assert sampling_params(job_sampling("qwen_vl", 3), 8, False, "sb7").seed is None
    # JSON mode: vLLM's structured-outputs object from the job's plain data, stopping at EOS
    json_mode = sampling_params(job_sampling("json", 3), 8, True, "sb7")
    assert json_mode.structured_outputs.json_object and not json_mode.ignore_eos
    assert json_mode.temperature == 0.0 and json_mode.seed is None


class FakeTokenizer:
    """No chat template: ``render`` tokenizes the plain text (one id per character)."""

    chat_template = None

    def __call__(self, text: str) -> dict:
        return {"input_ids": [ord(c) % 100 for c in text]}


def test_plan_keys_jobs_by_setting_and_keeps_greedy_names():
    from benchmarks.run import Plan, parse_args

    args = parse_args(["--quick", "--categories", "qa,coding", "--methods", "none,ngram,recap-tree",
                       "--sampling", "greedy,qwen_vl,t1", "--sampling-methods", "recap-tree",
                       "--sampling-seed", "4", "--out", "/tmp/unused"])
    plan = Plan(args, "/no/model", "float32", FakeTokenizer())
    names = [j["name"] for j in plan.jobs]
    assert names == ["none/spec_bench/c1/r0", "ngram/spec_bench/c1/r0", "recap-tree/spec_bench/c1/r0",
                     "none/spec_bench/qwen_vl/c1/r0", "recap-tree/spec_bench/qwen_vl/c1/r0",
                     "none/spec_bench/t1/c1/r0", "recap-tree/spec_bench/t1/c1/r0"]
    by_name = {j["name"]: j for j in plan.jobs}
    assert by_name["ngram/spec_bench/c1/r0"]["sampling"] == {"name": "greedy", "params": {"temperature": 0.0},
                                                             "seed": None}
    assert by_name["none/spec_bench/t1/c1/r0"]["sampling"]["seed"] == 4
    assert by_name["recap-tree/spec_bench/qwen_vl/c1/r0"]["sampling"]["seed"] is None
    assert all(j["prompts"] == plan.jobs[0]["prompts"] for j in plan.jobs)  # same prompts
    # without greedy only the other settings' batch-1 jobs run
    args = parse_args(["--sampling", "qwen_text", "--methods", "recap-chain", "--per-category", "1",
                       "--categories", "qa", "--out", "/tmp/unused"])
    plan = Plan(args, "/no/model", "float32", FakeTokenizer())
    assert [j["name"] for j in plan.jobs] == ["none/spec_bench/qwen_text/c1/r0",
                                              "recap-chain/spec_bench/qwen_text/c1/r0"]
    with pytest.raises(SystemExit):
        parse_args(["--sampling", "greedy,warm"])


# -- sampling report ------------------------------------------------------------------------

def test_tree_figures_definitions_and_merge_over_repeats():
    recs = {"a": _rec("a", 10, 1.0, drafts=6, draft_tokens=30, accepted_tokens=4, tree_steps=3,
                      off_chain_accepts=1),
            "b": _rec("b", 10, 1.0, drafts=2, draft_tokens=4, accepted_tokens=0, tree_steps=0,
                      off_chain_accepts=0)}
    fig = report.prompt_figures(recs, None)
    passes = 20 - 4
    assert fig["tree_steps"] == 3 and fig["tree_share"] == 3 / 8  # of drafted request-steps
    assert fig["tree_pass_share"] == 3 / passes
    assert fig["requests_with_trees"] == 1 and fig["tree_request_share"] == 0.5
    assert fig["off_chain_share"] == 1 / 3
    # no tree counts (a vLLM method): no tree keys at all
    assert "tree_share" not in report.prompt_figures({"a": _rec("a", 10, 1.0, drafts=2)}, None)
    jobs = [{"requests": [_rec("a", 4, 1.0, tree_steps=t, off_chain_accepts=o)]} for t, o in ((2, 0), (4, 2))]
    merged = report.merge_requests(jobs)["a"]
    assert merged["tree_steps"] == 3.0 and merged["off_chain_accepts"] == 1.0


def _sampling_results():
    """none / recap-chain / recap-tree under greedy, qwen_vl (one prompt differs) and qwen_text."""
    def job(method, sampling, pid_tokens, tree=None, **kw):
        reqs = []
        for pid, ids in pid_tokens.items():
            extra = {"tree_steps": tree[0], "off_chain_accepts": tree[1]} if tree else {}
            reqs.append({**_rec(pid, 0, 1.0 if method == "none" else 0.5, drafts=4, draft_tokens=8,
                                accepted_tokens=kw.get("acc", 0), **extra), "output_ids": ids})
        where = "spec_bench" if sampling == "greedy" else f"spec_bench/{sampling}"
        return {**_job(method, requests=reqs), "name": f"{method}/{where}/c1/r0", "sampling": sampling}

    same = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8]}
    return [
        job("none", "greedy", same), job("recap-tree", "greedy", same, tree=(4, 1), acc=2),
        job("none", "qwen_vl", same), job("recap-tree", "qwen_vl", {**same, "b": [5, 6, 0, 0]},
                                          tree=(4, 2), acc=2),
        job("none", "qwen_text", same),
        job("recap-chain", "qwen_text", {"a": [9, 9, 9, 9], "b": same["b"]}, acc=1),
        job("recap-tree", "qwen_text", {"a": [3, 3, 3, 3], "b": [4, 4, 4, 4]}, tree=(2, 1), acc=2),
    ]


def test_sampling_sections_pair_within_a_setting_and_skip_identity_for_sampled():
    results = _sampling_results()
    s = report.build_summary(results, ["none", "recap-chain", "recap-tree"], [1], [], [],
                             sampling=["greedy", "qwen_vl", "qwen_text"],
                             sampling_methods=["none", "recap-chain", "recap-tree"], sampling_seed=0)
    # the greedy tables are greedy's jobs only, as before
    assert [r["method"] for r in s["overall"]] == ["none", "recap-tree"]
    assert s["overall"][1]["identical"] == 2 and s["overall"][1]["tree_share"] == 1.0
    sec = {x["name"]: x for x in s["sampling"]}
    assert list(sec) == ["greedy", "qwen_vl", "qwen_text"]
    assert [sec[n]["seeded"] for n in sec] == [False, False, True]
    vl = {r["method"]: r for r in sec["qwen_vl"]["rows"]}
    assert vl["recap-tree"]["identical"] == 1 and vl["recap-tree"]["compared"] == 2  # deterministic
    assert vl["recap-tree"]["speedup_geomean"] == pytest.approx(2.0)
    text = {r["method"]: r for r in sec["qwen_text"]["rows"]}
    assert text["recap-tree"]["identity"] == "n/a" and text["recap-tree"]["identical"] is None
    assert text["recap-tree"]["tree_share"] == 2 / 4 and text["recap-tree"]["tree_request_share"] == 1.0
    assert "tree_share" not in text["recap-chain"]  # no tree counts recorded for it
    # findings: qwen_vl must equal none; qwen_text's differences are expected
    found = "\n".join(s["findings"])
    assert "sampling qwen_vl: recap-tree output differs from none on 1 of 2 prompts (b at token 2)" in found
    assert "qwen_text: recap" not in found
    # issue 12's targets: tokens/pass 8/4 = 2 everywhere for recap-tree; chain 8/6
    t = {x["target"]: x for x in s["sampling_targets"]}
    assert t["recap-tree tokens/pass under qwen_vl >= 0.95 x recap-tree under greedy"]["met"]
    chain = t["recap-tree tokens/pass under qwen_text >= 1.3 x recap-chain under qwen_text"]
    assert chain["value"] == pytest.approx(2.0 / (8 / 6)) and chain["met"]
    # unseeded sampled repeats may differ by design: not a finding
    twice = results + [{**results[-1], "name": "recap-tree/spec_bench/qwen_text/c1/r1", "repeat": 1,
                        "requests": [{**r, "output_ids": [0]} for r in results[-1]["requests"]]}]
    seeded = report.build_summary(twice, ["none"], [1], [], [], sampling=["qwen_text"],
                                  sampling_methods=["none", "recap-tree"], sampling_seed=0)
    assert ("sampling qwen_text: recap-tree produced different tokens in different repeats"
            in seeded["findings"])
    unseeded = report.build_summary(twice, ["none"], [1], [], [], sampling=["qwen_text"],
                                    sampling_methods=["none", "recap-tree"], sampling_seed=-1)
    assert not unseeded["findings"] and not unseeded["sampling"][0]["seeded"]
    # greedy-only runs keep the summary's old layout
    assert "sampling" not in report.build_summary(results, ["none", "recap-tree"], [1], [], [],
                                                  sampling=["greedy"])


def test_recap_rows_of_seeded_sampled_settings_in_float32_are_checked_against_none():
    """RECAP draws each position of a seeded request as vLLM does without speculation, so in a
    float32 run its rows of a seeded sampled setting must equal none's (a difference is a
    finding); unseeded, or in bf16, they are not checked."""
    results = _sampling_results() + [
        {**_sampling_results()[-1], "method": "ngram", "name": "ngram/spec_bench/qwen_text/c1/r0"}]
    methods = ["none", "ngram", "recap-chain", "recap-tree"]

    def text_rows(dtype, seed=0):
        s = report.build_summary(results, ["none"], [1], [], [], sampling=["qwen_text"],
                                 sampling_methods=methods, sampling_seed=seed, dtype=dtype)
        return {r["method"]: r for r in s["sampling"][0]["rows"]}, "\n".join(s["findings"])

    rows, found = text_rows("float32")
    assert rows["recap-chain"]["identical"] == 1 and rows["recap-chain"]["compared"] == 2
    assert rows["recap-tree"]["identical"] == 0 and rows["ngram"]["identity"] == "n/a"
    assert "sampling qwen_text: recap-tree output differs from none on 2 of 2 prompts" in found
    assert "ngram output differs" not in found
    for dtype, seed in (("bfloat16", 0), ("float32", -1)):
        rows, found = text_rows(dtype, seed)
        assert rows["recap-tree"]["identity"] == "n/a" and "differs" not in found


def test_sampling_markdown_sections_and_pivots():
    from benchmarks import report_sampling

    s = report.build_summary(_sampling_results(), ["none", "recap-tree"], [1], [], [],
                             sampling=["greedy", "qwen_vl", "qwen_text"],
                             sampling_methods=["none", "recap-chain", "recap-tree"])
    grid = {r["method"]: r for r in report_sampling.pivot(s["sampling"], "tokens_per_pass")}
    assert grid["recap-tree"]["qwen_text"] == 2.0 and grid["recap-chain"]["greedy"] is None
    text = "\n".join(markdown.sampling_parts(s))
    assert "## Sampling settings (Spec-Bench, batch 1)" in text
    for name in ("greedy", "qwen_vl", "qwen_text"):
        assert f"### Sampling `{name}`" in text
    assert "temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05" in text
    assert "a fixed seed per request" in text and "greedy-equivalent: outputs must equal none's" in text
    qwen_text = text.split("### Sampling `qwen_text`")[1]
    assert "| recap-tree |" in qwen_text and "| n/a |" in qwen_text and "| 50% |" in qwen_text
    assert "| 2/2 |" in qwen_text  # requests with trees
    assert "1/2" in text.split("### Sampling `qwen_vl`")[1].split("###")[0]  # identity kept
    assert ("target: recap-tree tokens/pass under qwen_vl >= 0.95 x recap-tree under greedy: "
            "1.00x (met)") in text
    assert markdown.sampling_parts({"overall": []}) == []


def test_sampler_fixes_only_for_non_greedy_jobs(monkeypatch):
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops import topk_topp_sampler

    from benchmarks.harness import install_sampler_fixes
    from benchmarks.sampling import job_sampling

    # restore vLLM's functions after the test, whatever install does
    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", rejection_sampler.expand_batch_to_tokens)
    monkeypatch.setattr(topk_topp_sampler, "apply_top_k_only", topk_topp_sampler.apply_top_k_only)
    # greedy jobs leave vLLM's functions as they are (whatever an earlier test installed)
    before = (rejection_sampler.expand_batch_to_tokens, topk_topp_sampler.apply_top_k_only)
    assert install_sampler_fixes({}) == []
    assert install_sampler_fixes({"sampling": job_sampling("greedy", 0)}) == []
    assert (rejection_sampler.expand_batch_to_tokens,
            topk_topp_sampler.apply_top_k_only) == before
    seams = install_sampler_fixes({"sampling": job_sampling("qwen_text", 0)})
    assert len(seams) == 2 and rejection_sampler.expand_batch_to_tokens.__recap_seam__ == seams[0]
    assert topk_topp_sampler.apply_top_k_only.__recap_seam__ == seams[1]


# -- float32 recheck of bf16 differences ----------------------------------------------------

def _phase_job(method, phase, recs, **kw):
    return {"method": method, "phase": phase, "concurrency": 1, "requests": recs, **kw}


def test_fp32_recheck_reruns_exactly_the_differing_prompts_and_reports_identity():
    from benchmarks import precision

    same, other = _rec("a", 8, 1.0), {**_rec("b", 8, 1.0), "output_ids": [0, 1, 9, 9, 9]}
    results = [_phase_job("none", "spec_bench", [_rec("a", 8, 1.0), _rec("b", 8, 1.0), _rec("c", 8, 1.0)]),
               _phase_job("ngram", "spec_bench", [same, other, _rec("c", 8, 1.0)]),
               _phase_job("recap-tree", "spec_bench", [_rec("a", 8, 1.0), _rec("b", 8, 1.0),
                                                 {**_rec("c", 8, 1.0), "output_ids": [7]}])]
    prompts = [{"prompt_id": p} for p in "abc"]

    def make_job(method, phase, concurrency, repeat, prompts):
        return {"method": method, "phase": phase, "prompts": prompts, "engine": {}}

    jobs = precision.recheck_jobs(results, ["none", "ngram", "recap-tree"], prompts, make_job,
                                  {"dtype": "bfloat16", "model": "m"})
    got = {j["method"]: [p["prompt_id"] for p in j["prompts"]] for j in jobs}
    assert got == {"none": ["b", "c"], "ngram": ["b"], "recap-tree": ["c"]}
    assert all(j["phase"] == precision.PHASE and j["engine"] == {"dtype": "float32", "model": "m"}
               for j in jobs)
    # float32: ngram identical again, recap-tree still differs at token 3
    results += [_phase_job("none", precision.PHASE, [_rec("b", 8, 1.0), _rec("c", 8, 1.0)]),
                _phase_job("ngram", precision.PHASE, [_rec("b", 8, 1.0)]),
                _phase_job("recap-tree", precision.PHASE, [{**_rec("c", 8, 1.0),
                                                      "output_ids": [0, 1, 2, 5]}])]
    rows = {r["method"]: r for r in precision.recheck_rows(results)}
    assert (rows["ngram"]["rechecked"], rows["ngram"]["identical_fp32"]) == (1, 1)
    assert rows["recap-tree"]["still_different"] == "c at token 3"
    assert precision.findings(list(rows.values())) == [
        "float32 recheck: the bf16 differences above are rounding -- identical to none in "
        "float32: ngram 1/1",
        "float32 recheck: recap-tree still differs from none on 1 of 1 prompts (c at token 3) - "
        "not explained by bf16 rounding"]
    text = markdown.markdown_table(list(rows.values()), markdown.FP32_RECHECK)
    assert "identical to none in float32" in text and "c at token 3" in text
    # nothing differed: no jobs
    assert precision.recheck_jobs(results[:1], ["none"], prompts, make_job, {}) == []
    # the job runner knows the phase (it serves the prompts like Spec-Bench's)
    from benchmarks.harness import PHASES

    assert PHASES[precision.PHASE] is PHASES["spec_bench"]


# -- interleaved A/B ------------------------------------------------------------------------

def _interleave_result(rows: dict, dtype: str = "float32", prompts: int = 4,
                       order: str | None = None, **args) -> dict:
    """A ``benchmarks.interleave`` result around summary ``rows`` (by engine), for markdown."""
    return {"args": {"model": "smollm2", "concurrency": 4, "max_new_tokens": 64, **args},
            "machine": {"cpu_model": "cpu", "cpus": 2, "cpu_flags": ["avx2"], "git": "abc"},
            "date": "d", "dtype": dtype, "prompts": prompts, "rows": list(rows.values()),
            **({"order": order} if order else {})}


def test_interleave_pairs_each_run_with_the_none_run_of_its_own_round():
    from benchmarks import interleave

    assert interleave.engines("recap-tree,recap-tree@/tmp/x") == [
        ("none", None), ("recap-tree", None), ("recap-tree", "/tmp/x")]
    runs = [{"engine": "none", "round": 0, "tokens_per_s": 100.0},
            {"engine": "recap-tree", "round": 0, "tokens_per_s": 90.0},
            {"engine": "none", "round": 1, "tokens_per_s": 120.0},   # the machine sped up
            {"engine": "recap-tree", "round": 1, "tokens_per_s": 126.0},
            {"engine": "recap-tree", "round": 2, "error": "boom"}]
    rows = {r["engine"]: r for r in interleave.summarize(runs, ["none", "recap-tree"])}
    assert rows["recap-tree"]["ratios"] == [0.9, 1.05]  # per round, not 108 / 110
    assert rows["recap-tree"]["median"] == pytest.approx(0.975)
    assert rows["recap-tree"]["errors"] == 1 and rows["none"]["ratios"] == [1.0, 1.0]
    result = _interleave_result(rows, rounds=3, dtype="bfloat16", prompts=26)
    text = interleave.markdown(result)
    assert "| recap-tree | 90.0, 126.0 | 0.90, 1.05 | 0.98x [0.90-1.05] | - | 1 |" in text


def test_interleave_reverses_the_engines_in_odd_rounds():
    """Where an engine runs in a round moved its speed by ~0.1 of plain decoding's (Qwen2.5-VL's
    settings, concurrency 4): alternating the order cancels that over pairs of rounds."""
    from benchmarks import interleave

    chosen = interleave.engines("recap-tree,recap-tree@/tmp/x,suffix")
    assert interleave.round_order(chosen, 0) == chosen
    assert interleave.round_order(chosen, 1) == chosen[::-1]
    assert interleave.round_order(chosen, 2) == chosen
    for r in range(4):  # every engine once per round
        assert sorted(interleave.round_order(chosen, r), key=str) == sorted(chosen, key=str)
    result = _interleave_result({}, rounds=2, order="alternating")
    assert "in reverse order in odd rounds" in interleave.markdown(result)
    del result["order"]  # results from before the alternation say nothing of it
    assert "reverse order" not in interleave.markdown(result)


def test_interleave_counts_tokens_per_pass_from_vllms_counters():
    """Each request's first token is its prefill's; every later pass commits one token plus
    what it accepted: 4 requests, 100 tokens, 36 accepted -> 96 decoded in 60 passes."""
    from benchmarks import interleave

    counters = {"drafts": 30, "draft_tokens": 90, "accepted_tokens": 36}
    run = {"engine": "recap-tree", "round": 0, "tokens_per_s": 90.0, "tokens": 100,
           "prompts": 4, "drafting": counters}
    assert interleave.pass_figures(run) == (1.6, 0.5)
    plain = {"engine": "none", "round": 0, "tokens_per_s": 80.0, "tokens": 100, "prompts": 4,
             "drafting": dict.fromkeys(counters, 0)}
    assert interleave.pass_figures(plain) == (1.0, 0.0)  # plain decoding: one token a pass
    assert interleave.pass_figures({**run, "drafting": None}) is None
    rows = {r["engine"]: r for r in interleave.summarize([plain, run], ["none", "recap-tree"])}
    assert rows["recap-tree"]["tokens_per_pass"] == 1.6
    assert rows["none"]["tokens_per_pass"] == 1.0
    result = _interleave_result(rows, rounds=1)
    assert "| 1.12x [1.12-1.12] | 1.60 (50%) | 0 |" in interleave.markdown(result)


def test_interleave_open_loop_ratio_is_none_latency_over_the_engines():
    """Open-loop runs are compared by latency (throughput follows the arrival rate): the ratio
    is the same round's ``none`` mean latency over the engine's, listed with the latencies."""
    from benchmarks import interleave

    runs = [{"engine": "none", "round": 0, "tokens_per_s": 50.0, "mean_latency_s": 2.0},
            {"engine": "recap-tree", "round": 0, "tokens_per_s": 51.0, "mean_latency_s": 1.6},
            {"engine": "none", "round": 1, "tokens_per_s": 50.0, "mean_latency_s": 3.0},
            {"engine": "recap-tree", "round": 1, "tokens_per_s": 49.0, "mean_latency_s": 3.3}]
    rows = {r["engine"]: r for r in interleave.summarize(runs, ["none", "recap-tree"])}
    assert rows["recap-tree"]["ratios"] == [1.25, pytest.approx(0.909, abs=1e-3)]
    assert rows["recap-tree"]["mean_latency_s"] == [1.6, 3.3]
    result = _interleave_result(rows, concurrency=16, rounds=2, arrival_rate=3.0,
                                arrival_seed=0, dtype="bfloat16", prompts=52)
    text = interleave.markdown(result)
    assert "Poisson arrivals at 3 requests/s" in text
    assert ("| recap-tree | 1.600, 3.300 | 51.0, 49.0 | 1.25, 0.91 | 1.08x [0.91-1.25] | - | 0 |"
            in text)


def test_interleave_arrival_times_are_one_seeded_poisson_schedule():
    from benchmarks.interleave import arrival_times

    times = arrival_times(4000, 5.0, seed=3)
    assert times == arrival_times(4000, 5.0, seed=3) != arrival_times(4000, 5.0, seed=4)
    gaps = np.diff(times)
    assert times[0] == 0.0 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)  # 1 / rate
    assert gaps.std() == pytest.approx(0.2, rel=0.1)  # exponential: std = mean


def _request(tokens: int, seconds: float, accepted: int = 0) -> dict:
    return {"tokens": tokens, "seconds": seconds, "accepted_tokens": accepted}


def test_interleave_categories_pair_each_category_with_its_rounds_none():
    """Batch 1: a category's speed is its requests' tokens over their seconds, paired with the
    same round's ``none`` (a round where the machine ran slow for everyone cancels out)."""
    from benchmarks import interleave
    from benchmarks.category_rounds import category_rows, leads, rivals

    categories = ["rag", "qa", "rag"]
    runs = [  # round 1 ran at half speed for every engine
        {"engine": "none", "round": 0,
         "requests": [_request(10, 1.0), _request(10, 1.0), _request(10, 1.0)]},
        {"engine": "none", "round": 1,
         "requests": [_request(10, 2.0), _request(10, 2.0), _request(10, 2.0)]},
        {"engine": "recap-tree", "round": 0,
         "requests": [_request(10, 0.5, 4), _request(10, 1.0, 0), _request(10, 0.5, 5)]},
        {"engine": "recap-tree", "round": 1,
         "requests": [_request(10, 1.0, 4), _request(10, 2.5, 0), _request(10, 1.0, 5)]},
        {"engine": "suffix", "round": 0,
         "requests": [_request(10, 0.4, 6), _request(10, 1.0, 0), _request(10, 0.4, 6)]},
        {"engine": "suffix", "round": 1, "error": "boom"},  # left out
    ]
    table = category_rows(runs, ["none", "recap-tree", "suffix"], categories)
    rows = {r["category"]: r["engines"] for r in table}
    assert list(rows) == ["rag", "qa"]
    assert rows["rag"]["recap-tree"]["ratios"] == [2.0, 2.0]  # not 2.0 and 4.0
    assert rows["qa"]["recap-tree"]["ratios"] == [1.0, 0.8]
    assert rows["qa"]["recap-tree"]["median"] == pytest.approx(0.9)
    assert rows["rag"]["suffix"]["ratios"] == [2.5]
    # rag, recap-tree: 4 requests x 9 decoded tokens, 18 accepted -> 36 / 18 passes
    assert rows["rag"]["recap-tree"]["tokens_per_pass"] == 2.0
    assert rows["qa"]["none"]["tokens_per_pass"] == 1.0
    assert leads(table, "suffix") == (2, 2)  # rag 2.5 > 2.0; qa 1.0 >= 0.9
    assert leads(table, "recap-tree") == (0, 2)
    # RECAP's methods are counted against vLLM's, not against each other
    assert rivals("recap-tree", ["none", "recap-tree", "recap-tree-b16", "suffix", "ngram"]) \
        == ["suffix", "ngram"]
    assert rivals("suffix", ["none", "recap-tree", "suffix", "ngram"]) == ["recap-tree"]
    assert rivals("recap-tree@/tmp/x", ["none", "recap-tree", "recap-tree@/tmp/x"]) \
        == ["recap-tree"]  # no vLLM method in the run: every other engine
    result = {**_interleave_result({}, concurrency=1, rounds=2), "categories": table,
              "rows": [{"engine": n, "tokens_per_s": [], "ratios": [], "median": None,
                        "errors": 0} for n in ("none", "recap-tree", "suffix")]}
    text = interleave.markdown(result)
    assert "| category | recap-tree | suffix |" in text
    assert "| rag | 2.00x [2.00-2.00], 2.00 | 2.50x [2.50-2.50], 3.00 |" in text
    assert "- suffix: at or above recap-tree in 2 of 2 categories" in text
    assert "## Per category" not in interleave.markdown({**result, "categories": []})


def test_interleave_counts_outputs_identical_to_the_rounds_none():
    from benchmarks import interleave
    from benchmarks.category_rounds import category_rows, identical

    def run(engine, r, outputs):
        return {"engine": engine, "round": r,
                "requests": [{**_request(len(o), 1.0), "output_ids": o} for o in outputs]}

    runs = [run("none", 0, [[1, 2], [3, 4]]), run("none", 1, [[1, 2], [3, 5]]),
            run("recap-tree", 0, [[1, 2], [3, 4]]), run("recap-tree", 1, [[1, 2], [3, 4]]),
            run("suffix", 0, [[1, 2], [3, 4]])]
    assert identical(runs, "recap-tree") == (3, 4)  # round 1's none went another way
    assert identical(runs, "suffix") == (2, 2)
    assert identical([{**r, "requests": [{"tokens": 1, "seconds": 1.0}]} for r in runs],
                     "suffix") is None  # older results kept no outputs
    names = ["none", "recap-tree", "suffix"]
    result = {**_interleave_result({}, concurrency=1, rounds=2), "categories": category_rows(
        runs, names, ["qa", "qa"]), "identical": {"recap-tree": [3, 4], "suffix": [2, 2]},
        "rows": [{"engine": n, "tokens_per_s": [], "ratios": [], "median": None, "errors": 0}
                 for n in names]}
    assert ("Outputs identical to the same round's `none`, requests over all rounds: "
            "recap-tree 3/4, suffix 2/2.") in interleave.markdown(result)
