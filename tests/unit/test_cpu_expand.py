"""The CPU replacement for vLLM's expand_batch_to_tokens keeps dtype and values."""
from __future__ import annotations

import pytest
import torch

from vllm_recap.patches.cpu_expand import expand_batch_to_tokens

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expands_per_request_values_to_tokens(dtype):
    x = torch.tensor([3, -1, 7], dtype=dtype)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = expand_batch_to_tokens(x, cu, 6, replace_from=-1, replace_to=1)
    assert out.dtype == dtype
    assert out.tolist() == [3, 3, 1, 1, 1, 7]


def test_zero_token_requests_and_float_temperatures():
    x = torch.tensor([0.8, -1.0, 0.5])
    cu = torch.tensor([1, 1, 4], dtype=torch.int32)
    out = expand_batch_to_tokens(x, cu, 4, replace_from=-1, replace_to=1)
    assert torch.allclose(out, torch.tensor([0.8, 0.5, 0.5, 0.5]))


def test_vllm_cpu_kernel_wrapper_is_broken_for_floats():
    """Documents the bug this seam works around: the stock CPU override leaves float outputs
    unwritten. If vLLM fixes it, this test fails and the seam can be retired."""
    pytest.importorskip("vllm")
    import vllm._custom_ops  # noqa: F401  (loads the C++ ops)
    from vllm.utils.cpu_triton_utils import _expand_kernel_impl

    out = torch.full((4,), -123.0)
    _expand_kernel_impl(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 4]), -1, 1)
    assert out.tolist() == [-123.0] * 4
