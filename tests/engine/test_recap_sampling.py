"""Sampled requests (temperature > 0) keep the target's distribution under RECAP.

They get single-path drafts verified by vLLM's rejection sampler, which is lossless in
distribution. A two-sample chi-square test per output position compares 400 samples with and
without RECAP (same engine seed, so the test is repeatable); drafts must actually have been
accepted for the test to mean anything.
"""
from __future__ import annotations

import collections

import pytest

from benchmarks.harness import spec_counters
from tests.conftest import make_llm


N = 400


def chi2_critical_999(dof: int) -> float:
    """Upper 0.1% point of chi-square(dof), Wilson-Hilferty approximation (within 2% for
    dof >= 3; the table value for smaller dof)."""
    if dof <= 2:
        return {1: 10.83, 2: 13.82}[dof]
    z = 3.090  # standard normal upper 0.1% point
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def homogeneity_chi2(a: list[int], b: list[int], min_expected: float = 5.0) -> tuple[float, int]:
    """Two-sample chi-square statistic over categories, rare ones pooled; (statistic, dof)."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    total = len(a) + len(b)
    cats, rare_a, rare_b = [], 0, 0
    for key in set(ca) | set(cb):
        if (ca[key] + cb[key]) / 2 >= min_expected:
            cats.append((ca[key], cb[key]))
        else:
            rare_a, rare_b = rare_a + ca[key], rare_b + cb[key]
    if rare_a + rare_b:
        cats.append((rare_a, rare_b))
    stat = 0.0
    for xa, xb in cats:
        col = xa + xb
        for x, n in ((xa, len(a)), (xb, len(b))):
            expected = n * col / total
            stat += (x - expected) ** 2 / expected
    return stat, len(cats) - 1


@pytest.mark.unit
def test_chi2_critical_values_match_tables():
    for dof, table in ((5, 20.52), (10, 29.59), (20, 45.31), (40, 73.40)):
        assert abs(chi2_critical_999(dof) - table) / table < 0.02


@pytest.mark.engine
def test_sampled_outputs_keep_the_target_distribution(tiny_qwen2):
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.15, max_tokens=5, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=[1, 2, 3, 4, 5])
    samples = {}
    # batch_node_budget 0: all 400 requests draft (the load policy would otherwise stop drafts)
    for name, spec in (("plain", None), ("recap", {"method": "recap", "batch_node_budget": 0})):
        with make_llm(tiny_qwen2, speculative_config=spec) as llm:
            samples[name] = [list(o.outputs[0].token_ids)
                             for o in llm.generate([prompt] * N, params, use_tqdm=False)]
            if spec is not None:
                counters = spec_counters(llm)
    assert counters["accepted_tokens"] > 100, "too few accepted drafts to test anything"
    for pos in range(1, 5):
        stat, dof = homogeneity_chi2([s[pos] for s in samples["plain"]],
                                     [s[pos] for s in samples["recap"]])
        assert dof >= 1
        assert stat < chi2_critical_999(dof), f"position {pos}: chi2 {stat:.1f} with {dof} dof"
