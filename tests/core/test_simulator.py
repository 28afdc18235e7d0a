"""Replay simulator: lossless output, vLLM-style acceptance, RECAP and Token Recycling."""

from __future__ import annotations

import numpy as np
import pytest

from tests.core.targets import NGramTarget, PoolTarget, RecordedTarget, TableTarget
from vllm_recap.core import Drafter, Policy, RecapConfig
from vllm_recap.core.simulator import simulate

pytestmark = pytest.mark.unit

PROMPTS = [[3, 4, 5, 6], [10, 11, 3, 4], [7]]


@pytest.mark.parametrize(
    "cfg",
    [
        RecapConfig(),
        RecapConfig(policy=Policy.TOKEN_RECYCLING, node_budget=80),
        RecapConfig(tree_shape="fixed"),
        RecapConfig(fusion="backoff"),
        RecapConfig(fusion="uniform"),
        RecapConfig(fusion="priors_fixed"),
        RecapConfig(use_context_memories=False),
        RecapConfig(persistent_unigram=False),
        RecapConfig(suffix_len=0),
        RecapConfig(node_budget=8, max_depth=3, max_context_rows=16),
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.to_dict().items()
                           if v != RecapConfig().to_dict()[k]) or "default",
)
def test_output_equals_greedy_stream(cfg: RecapConfig) -> None:
    target = NGramTarget(48, order=2, seed=1, skew=1.5)
    result = simulate(Drafter(cfg, 48, blocked_token_ids=[47]), target, PROMPTS, 60,
                      seed_prompt_rows=True)
    assert result.outputs == [target.greedy(p, 60) for p in PROMPTS]
    s = result.stats
    assert s.decode_tokens == 3 * 59  # the first token of each prompt comes from prefill
    assert s.steps >= s.draft_steps > 0
    assert s.acceptance_length == 1 + s.accepted_tokens / s.draft_steps
    assert s.tokens_per_pass == s.decode_tokens / s.steps
    assert s.as_dict()["mean_drafts"] > 0


@pytest.mark.parametrize(("policy", "budget", "minimum"),
                         [(Policy.RECAP, 63, 10.0), (Policy.TOKEN_RECYCLING, 80, 6.5)])
def test_repetitive_stream_approaches_the_depth_limit(policy: Policy, budget: int,
                                                      minimum: float) -> None:
    # Greedy stream cycles through 20 distinct tokens; a confident target. RECAP's limit is
    # max(max_depth, suffix_len) + 1 = 17 tokens per step (continuations of the repeated text
    # go deeper than memory nodes); Token Recycling's template is 6 deep (limit 7).
    target = TableTarget.cycle(64, period=20, confidence=0.99)
    cfg = RecapConfig(policy=policy, node_budget=budget)
    result = simulate(Drafter(cfg, 64), target, [[3, 4, 5], [10, 11]], 200)
    assert result.stats.acceptance_length >= minimum
    limit = 1 + max(cfg.max_depth, cfg.suffix_len) if policy is Policy.RECAP else 7
    assert result.stats.acceptance_length <= limit


def test_acceptance_counts_like_vllm() -> None:
    # Steps without a draft are not counted by vLLM's acceptance length, only per pass.
    target = TableTarget.cycle(64, period=20, confidence=0.99)
    s = simulate(Drafter(RecapConfig(), 64), target, [[3]], 100).stats
    assert s.steps > s.draft_steps  # the first lap of the cycle has nothing to draft from
    assert s.acceptance_length > s.tokens_per_pass


def test_recorded_target_replays_its_stream() -> None:
    base = NGramTarget(40, order=2, seed=3, skew=1.5)
    prompt = [1, 2, 3]
    stream = base.greedy(prompt, 50)
    seq = prompt + stream
    tail = [base.row(base._tail(seq[: j + 1])) for j in range(len(seq) - 1)]
    recorded = RecordedTarget(seq, np.stack([r[0] for r in tail]), np.stack([r[1] for r in tail]),
                              fallback=NGramTarget(40, order=1, seed=9))
    result = simulate(Drafter(RecapConfig(), 40), recorded, [prompt], 50)
    assert result.outputs == [stream]


def test_pool_target_is_consistent_with_its_greedy_stream() -> None:
    target = PoolTarget(500, pool_size=256, seed=2)
    prompts = [[1, 2, 3], [40, 41]]
    result = simulate(Drafter(RecapConfig(), 500), target, prompts, 40, seed_prompt_rows=True)
    assert result.outputs == [target.greedy(p, 40) for p in prompts]


class _LyingTarget(NGramTarget):
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        return [0] * n


def test_mismatch_with_greedy_is_reported() -> None:
    with pytest.raises(AssertionError, match="differs from greedy at token 0"):
        simulate(Drafter(RecapConfig(), 32), _LyingTarget(32, seed=4), [[5, 6]], 10)
