"""The sort-free top-k + top-p filter equals vLLM's ``apply_top_k_top_p`` bit for bit, and
sorts only rows it cannot decide from their k largest logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.sample.ops import topk_topp_sampler
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

from vllm_recap.vllm import top_k_top_p as filt
from vllm_recap.vllm.top_k_top_p import top_k_top_p

pytestmark = pytest.mark.unit


def _vllm(x, k, p):
    return apply_top_k_top_p(x.clone(), None if k is None else k.clone(),
                             None if p is None else p.clone())


def _rows(seed: int, m: int, vocab: int, scale: float, dtype=torch.bfloat16) -> torch.Tensor:
    """[m, vocab] float32 logits with the value grid of a bf16 model (ties happen)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, vocab, generator=g) * scale).to(dtype).float()


@pytest.mark.parametrize("vocab", [64, 49152])
def test_equals_vllm_on_qwen_text_rows(vocab):
    x = _rows(0, 17, vocab, 3.0) / 0.7
    k = torch.full((17,), 20, dtype=torch.int32)
    p = torch.full((17,), 0.8)
    assert torch.equal(top_k_top_p(x.clone(), k, p), _vllm(x, k, p))


def test_mixed_rows_ties_and_cuts_equal_vllm():
    """Rows without top-k, with k = V, ties at the threshold, ties across the top-p cut, a
    cumulative sum on the cut, -inf among the k largest: each equals vLLM's."""
    vocab = 200
    x = _rows(1, 8, vocab, 2.0)
    k = torch.tensor([5, vocab, 12, 3, 7, 4, 6, 10], dtype=torch.int32)
    p = torch.tensor([0.9, 0.5, 0.7, 1.0, 0.6, 0.8, 0.95, 0.3])
    x[2, :14] = 5.0  # ties at the threshold (k = 12)
    x[3, :3] = torch.tensor([4.0, 3.0, 3.0])  # ties below the largest, p = 1
    x[4] = -float("inf")
    x[4, :4] = torch.tensor([1.0, 1.0, 0.5, 0.2])  # fewer finite logits than k
    # row 5: four survivors of equal mass, p = 0.8: the cut (0.2) falls on a cumulative sum
    # and between equal logits
    x[5] = -20.0
    x[5, 10:14] = 2.0
    got = top_k_top_p(x.clone(), k, p)
    assert torch.equal(got, _vllm(x, k, p))


def test_rows_without_top_p_or_top_k_are_vllms_own():
    x = _rows(2, 4, 300, 2.0)
    k = torch.tensor([3, 300, 20, 7], dtype=torch.int32)
    assert torch.equal(top_k_top_p(x.clone(), k, None), _vllm(x, k, None))
    p = torch.tensor([0.9, 0.5, 0.7, 1.0])
    assert torch.equal(top_k_top_p(x.clone(), None, p), _vllm(x, None, p))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), m=st.integers(1, 9),
       vocab=st.sampled_from([8, 33, 512]), scale=st.sampled_from([0.05, 1.0, 4.0, 30.0]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       data=st.data())
def test_property_equals_vllm(seed, m, vocab, scale, dtype, data):
    x = _rows(seed, m, vocab, scale, dtype)
    k = torch.tensor(data.draw(st.lists(st.integers(1, vocab), min_size=m, max_size=m)),
                     dtype=torch.int32)
    p = torch.tensor(data.draw(st.lists(st.sampled_from([0.001, 0.3, 0.5, 0.8, 0.95, 1.0]),
                                        min_size=m, max_size=m)), dtype=torch.float32)
    assert torch.equal(top_k_top_p(x.clone(), k, p), _vllm(x, k, p))


def _peaked(seed: int, m: int, vocab: int) -> torch.Tensor:
    """Rows shaped like a language model's: a few dozen candidates a few logits apart above
    a broad floor (bf16 values)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, vocab, generator=g) * 2
    top = torch.randperm(vocab, generator=g)[:40]
    x[:, top] += torch.linspace(14, 4, 40) + torch.rand(m, 40, generator=g)
    return x.to(torch.bfloat16).float()


def test_decided_rows_are_not_sorted(monkeypatch):
    """Qwen2.5 text settings on 49k-wide rows: no row goes through vLLM's sorting filter
    (before this module every tree row did, ~2-3 ms each on a 2-core CPU) but those with
    equal logits on both sides of the top-p cut, whose fate is vLLM's sort order."""
    sorted_rows = []
    original = topk_topp_sampler.apply_top_k_top_p

    def counting(logits, k, p):
        sorted_rows.append(logits.shape[0])
        return original(logits, k, p)

    x = _peaked(3, 9, 49152) / 0.7
    k = torch.full((9,), 20, dtype=torch.int32)
    p = torch.full((9,), 0.8)
    want = _vllm(x, k, p)
    monkeypatch.setattr(topk_topp_sampler, "apply_top_k_top_p", counting)
    assert torch.equal(top_k_top_p(x.clone(), k, p), want)
    _, exact = filt._small_rows(x.clone(), k.long(), p)
    assert sum(sorted_rows) == int((~exact).sum()) <= 1, sorted_rows


def test_ties_and_near_cuts_are_left_to_vllm(monkeypatch):
    """The rows the small computation cannot decide are the ones handed to vLLM."""
    x = _rows(4, 4, 100, 1.0)
    x[0, :20] = 3.0  # a tie at the threshold (k = 4) running past the columns taken
    x[1] = -30.0
    x[1, :2] = 1.0  # two equal survivors, p = 0.5: the cut is on the first's sum
    x[3, :6] = 3.0  # a tie at the threshold (k = 4) within them: decided here
    k = torch.tensor([4, 2, 6, 4], dtype=torch.int32)
    p = torch.tensor([0.9, 0.5, 0.9, 0.95])
    _, exact = filt._small_rows(x.clone(), k.long(), p)
    assert exact.tolist() == [False, False, True, True]
    assert np.array_equal(top_k_top_p(x.clone(), k, p).numpy(), _vllm(x, k, p).numpy())
