"""The runner seam refuses a runner class that bypasses it (needs vLLM's runner class)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_runner_overriding_a_wrapped_method_is_refused():
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_recap.patches import SeamError
    from vllm_recap.patches import runner as seam

    seam.install()

    class MyRunner(GPUModelRunner):
        def _sample(self, logits, spec_decode_metadata):  # bypasses RECAP's seam
            return None

    runner = MyRunner.__new__(MyRunner)
    with pytest.raises(SeamError, match=r"MyRunner overrides _sample"):
        seam.verify_runner(runner, ())
    plain = GPUModelRunner.__new__(GPUModelRunner)
    with pytest.raises(SeamError, match="has no input_batch"):
        seam.verify_runner(plain, ("input_batch.req_ids",))
