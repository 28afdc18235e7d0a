"""Tree-aware metrics: per-depth acceptance and acceptance length."""
from __future__ import annotations

import pytest

from vllm_recap.vllm.metrics import TreeMetrics

pytestmark = pytest.mark.unit


def test_per_depth_acceptance_and_means():
    m = TreeMetrics()
    m.record(num_nodes=8, tree_depth=3, num_accepted=2)
    m.record(num_nodes=4, tree_depth=2, num_accepted=0)
    m.record(num_nodes=0, tree_depth=0, num_accepted=0)  # no draft: not a verification step
    s = m.snapshot()
    assert s["steps"] == 2 and s["mean_nodes"] == 6.0
    assert s["acceptance_length"] == 2.0  # (2 + 0) / 2 + 1
    # depth 1 reached twice, accepted once; depth 2 reached twice, accepted once; depth 3 once, 0
    assert s["per_depth_acceptance"] == [0.5, 0.5, 0.0]
