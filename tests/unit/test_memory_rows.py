"""Memory rows of processed requests (prompt seeds and rows of steps without a tree)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from vllm_recap.vllm.memory_rows import memory_state, process_rows
from vllm_recap.vllm.verifier import topk_rows

QWEN_VL = dict(temperature=0.1, top_k=1, top_p=0.001, repetition_penalty=1.05)


@pytest.mark.parametrize("kwargs, expected", [
    (dict(temperature=0.0), None),                      # plain greedy: raw rows
    (dict(temperature=0.1, top_k=1), None),             # greedy-equivalent, nothing moves a row
    (QWEN_VL, (0.0, 1.05)),                             # ranked as greedy, penalised
    (dict(temperature=0.0, presence_penalty=0.5), (0.0, 1.0)),
    (dict(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05), None),  # sampled
    (dict(temperature=1.0), None),
])
def test_memory_state_says_which_rows_move(kwargs, expected) -> None:
    state = memory_state(SamplingParams(**kwargs), [1, 2, 3], [4])
    if expected is None:
        assert state is None
    else:
        assert (state.temperature, state.repetition_penalty) == expected


def test_memory_state_without_a_prompt_keeps_raw_rows_under_a_repetition_penalty() -> None:
    assert memory_state(SamplingParams(**QWEN_VL), None, ()) is None


def _logits(rows: list[dict[int, float]], vocab: int = 32) -> torch.Tensor:
    out = torch.full((len(rows), vocab), -5.0)
    for r, row in enumerate(rows):
        for token, value in row.items():
            out[r, token] = value
    return out


def test_a_penalised_row_ranks_an_unseen_token_above_a_seen_one() -> None:
    # Row 0: raw top-1 is token 3 (20.0), seen in the prompt; token 9 (19.5) is unseen. With
    # repetition penalty 1.05, 20.0 -> 19.05: the processed argmax is 9 (what vLLM samples).
    # Row 1 is not processed. Row 2: token 7 is on the row's path (a chain draft), so it is
    # penalised too: 18.0 -> 17.14 < 17.5.
    logits = _logits([{3: 20.0, 9: 19.5, 4: 10.0}, {3: 20.0, 9: 19.5}, {7: 18.0, 8: 17.5}])
    ids, probs = topk_rows(logits, 4)
    raw_ids, raw_probs = ids.copy(), probs.copy()
    assert ids[0, 0] == 3 and ids[2, 0] == 7
    state = memory_state(SamplingParams(**QWEN_VL), [1, 3], [5])
    process_rows(logits, np.array([0, 2]), ids, probs, state, [(), (7,)])
    assert ids[0, :2].tolist() == [9, 3] and ids[2, :2].tolist() == [8, 7]
    np.testing.assert_allclose(probs[[0, 2]].sum(axis=1), 1.0, rtol=1e-6)
    assert probs[0, 0] > probs[0, 1]
    np.testing.assert_array_equal(ids[1], raw_ids[1])  # rows not named stay as they were
    np.testing.assert_array_equal(probs[1], raw_probs[1])
    # the same set of candidates, re-ranked
    assert sorted(ids[0].tolist()) == sorted(raw_ids[0].tolist())
