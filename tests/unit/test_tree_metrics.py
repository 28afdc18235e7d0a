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


def test_the_metrics_line_reports_acceptance_per_source(caplog):
    """Issue 14: acceptance per depth and per node source reaches the log, from the drafter's
    own counts after real verified steps."""
    import logging

    import numpy as np

    from vllm_recap.core import Drafter, RecapConfig

    drafter = Drafter(RecapConfig(node_budget=8), 64)
    text = [5, 6, 7, 8, 9] * 4
    drafter.start("r", text)
    for _ in range(6):
        tree = drafter.propose("r")
        n = tree.num_nodes
        k = 8
        drafter.observe("r", tree.tokens, tree.parents, np.tile(np.arange(k), (n, 1)),
                        np.full((n, k), 1 / k, np.float32))
        # the periodic text continues: the continuation nodes hold
        nxt = [text[(len(drafter.history("r")) + i) % 5] for i in range(2)]
        drafter.commit("r", nxt)
    m = TreeMetrics(log_interval_s=0.0)
    m.record(num_nodes=8, tree_depth=3, num_accepted=1)
    with caplog.at_level(logging.INFO, logger="vllm.recap"):
        m.maybe_log(1, drafter.acceptance_snapshot)
    line = caplog.records[-1].getMessage()
    assert "per-source acceptance by depth: " in line and "suffix [" in line, line
    snap = drafter.acceptance_snapshot()
    assert sum(snap["suffix"]["held"]) > 0
