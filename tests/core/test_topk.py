"""The compiled top-K over float rows read as integers: exact against numpy, ties by id."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_recap.core import topk as T

pytestmark = pytest.mark.unit


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (truncation; any bfloat16 values will do here)."""
    return (np.ascontiguousarray(x, np.float32).view(np.int32) >> 16).astype(np.int16)


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.int32) << 16).view(np.float32)


def _reference(values: np.ndarray, k: int) -> np.ndarray:
    """ids of the k largest values per row, lower id first among equal values (numpy)."""
    return np.argsort(-values, axis=1, kind="stable")[:, :k]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 4), vocab=st.integers(1, 700), k=st.integers(1, 9),
       levels=st.sampled_from([3, 50, 10_000]), negative=st.booleans(),
       seed=st.integers(0, 2**31 - 1), wide=st.booleans())
def test_top_k_is_exact_with_ties(rows, vocab, k, levels, negative, seed, wide):
    """Values drawn from few levels (many ties, across chunk borders), all-negative rows and
    the partial last chunk: ids equal a stable sort's, both for int16 and int32 patterns."""
    k = min(k, vocab)
    rng = np.random.default_rng(seed)
    values = rng.integers(-levels, levels, (rows, vocab)).astype(np.float32) / 7
    if negative:
        values = -np.abs(values) - 0.5
    if wide:
        bits = np.ascontiguousarray(values).view(np.int32)
        exact = values
    else:
        bits = _bf16_bits(values)
        exact = _bf16_values(bits)
    ids, top = T.topk_bits(bits, k)
    np.testing.assert_array_equal(ids, _reference(exact, k))
    np.testing.assert_array_equal(top, np.take_along_axis(bits, ids, 1))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 3), chunks=st.integers(1, 12), k=st.sampled_from([2, 8, 16, 64]),
       levels=st.sampled_from([2, 40, 10_000]), seed=st.integers(0, 2**31 - 1),
       wide=st.booleans())
def test_top_k_over_many_chunks_is_exact_at_the_chunk_floor(rows, chunks, k, levels, seed,
                                                            wide):
    """k of a sampled row's candidates (64) and rows of more chunks than k: only entries at
    or above the k-th best chunk maximum are searched, so the ties at that floor (few levels)
    and rows whose top k sit in fewer chunks than k must still come out as a stable sort's."""
    vocab = chunks * k * T.CHUNK // 4 + seed % 7
    rng = np.random.default_rng(seed)
    values = rng.integers(-levels, levels, (rows, vocab)).astype(np.float32) / 3
    bits = np.ascontiguousarray(values).view(np.int32) if wide else _bf16_bits(values)
    exact = values if wide else _bf16_values(bits)
    ids, top = T.topk_bits(bits, min(k, vocab))
    np.testing.assert_array_equal(ids, _reference(exact, min(k, vocab)))
    np.testing.assert_array_equal(top, np.take_along_axis(bits, ids, 1))


def test_negative_zero_equals_zero_and_argmax_takes_the_lower_id():
    values = np.full((2, 300), -1.0, np.float32)
    values[0, 5], values[0, 200] = -0.0, 0.0
    values[1, 250], values[1, 7] = 0.0, -0.0
    for bits in (values.view(np.int32), _bf16_bits(values)):
        assert T.topk_bits(bits, 1)[0][:, 0].tolist() == [5, 7]


def test_bad_input_is_refused_with_its_reason():
    with pytest.raises(TypeError, match="int16 or int32"):
        T.topk_bits(np.zeros((2, 4), np.float32), 1)
    with pytest.raises(ValueError, match="outside"):
        T.topk_bits(np.zeros((2, 4), np.int16), 5)


def test_warmup_compiles_both_specialisations():
    from vllm_recap.core import warmup

    warmup()
    kinds = {str(sig[0]) for sig in T._topk_bits.signatures}
    assert any("int16" in s for s in kinds) and any("int32" in s for s in kinds), kinds


@pytest.mark.parametrize("wide", [False, True])
def test_topk_probs_is_the_softmax_over_the_top_values(wide):
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((5, 1000)) * 4).astype(np.float32)
    bits = np.ascontiguousarray(values).view(np.int32) if wide else _bf16_bits(values)
    exact = values if wide else _bf16_values(bits)
    ids, probs = T.topk_probs(bits, 8, bfloat16=not wide)
    np.testing.assert_array_equal(ids, _reference(exact, 8))
    top = np.take_along_axis(exact, ids, axis=1).astype(np.float64)
    want = np.exp(top - top[:, :1]) / np.exp(top - top[:, :1]).sum(axis=1, keepdims=True)
    assert probs.dtype == np.float32
    np.testing.assert_allclose(probs, want, rtol=1e-6)
    with pytest.raises(TypeError, match="bfloat16"):
        T.topk_probs(bits, 8, bfloat16=wide)
