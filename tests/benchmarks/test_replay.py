"""benchmarks.replay: each proposal's best chain against the tokens the request committed."""
from __future__ import annotations

import json

import pytest

from benchmarks import replay
from benchmarks.replay import Proposal, accepted_prefix


@pytest.mark.unit
def test_a_chain_is_accepted_while_it_equals_the_committed_tokens():
    tokens = [5, 6, 7, 8, 9]
    assert accepted_prefix([7, 8, 1], tokens, 2) == 2
    assert accepted_prefix([1, 8], tokens, 2) == 0
    assert accepted_prefix([9, 10], tokens, 4) == 1  # the output ends after one node
    assert accepted_prefix([], tokens, 0) == 0


@pytest.mark.unit
def test_proposals_are_grouped_by_what_the_step_did_with_them():
    outputs = {"a": [1, 2, 3, 4, 5, 6], "b": [9, 8, 7, 6]}
    proposals = [
        # drafted in a full batch of 2: the first node right, the second wrong
        Proposal(0, "a", 2, [3, 0], [0.9, 0.5], scheduled=2, proposing=2),
        Proposal(0, "b", 2, [7, 6], [0.4, 0.3], scheduled=0, proposing=2),  # declined, 2 right
        Proposal(1, "a", 4, [5, 6], [0.2, 0.1], scheduled=0, proposing=1, draining=True),
        Proposal(2, "b", 4, [1], [0.5]),  # after the last token: nothing to check
        Proposal(2, "c", 1, [1], [0.5]),  # unknown request: skipped
    ]
    groups = replay.replay(proposals, outputs, full=2, depth=2)
    assert groups == {
        "drafted full": {"proposals": 1, "accepted": 1.0, "expected": pytest.approx(1.4),
                         "with_chain": 1.0},
        "declined full": {"proposals": 1, "accepted": 2.0, "expected": pytest.approx(0.7),
                          "with_chain": 1.0},
        "declined partial drain": {"proposals": 1, "accepted": 2.0,
                                   "expected": pytest.approx(0.3), "with_chain": 1.0},
    }
    # depth bounds the nodes replayed and expected
    one = replay.replay(proposals, outputs, full=2, depth=1)
    assert one["declined full"]["accepted"] == 1.0
    assert one["declined full"]["expected"] == pytest.approx(0.4)


@pytest.mark.engine
def test_replay_records_every_proposal_of_a_real_engine(capsys, tmp_path):
    out = tmp_path / "replay.json"
    result = replay.main(["--prompts", "2", "--max-new-tokens", "16", "--concurrency", "2",
                          "--out", str(out)])
    printed = capsys.readouterr().out
    assert "proposals; first 2 nodes of each best chain replayed" in printed
    saved = json.loads(out.read_text())
    assert saved["proposals"] == len(saved["records"]) > 0
    # every proposal that had a later token to check was replayed into some group
    assert sum(g["proposals"] for g in result["groups"].values()) > 0
    for g in result["groups"].values():
        assert 0 <= g["accepted"] <= 2 and 0 <= g["expected"] <= 2
    assert {r["request"] for r in saved["records"]} and all(
        r["num_tokens"] > 0 and len(r["chain"]) == len(r["probs"]) for r in saved["records"])


@pytest.mark.unit
def test_verified_nodes_are_tabulated_by_source_and_depth_with_their_prior_estimate():
    """The recorder gives each verified node the probability the calibration held before
    its tree was observed (what the controller chose by), with its source and outcome."""
    import numpy as np

    from vllm_recap.core.budget import BudgetController
    from vllm_recap.core.config import RecapConfig

    ctl = BudgetController(8, RecapConfig().depth_discounts)
    nodes = replay.record_verified(ctl)
    parents, scores = np.array([-1, 0, 1, 0]), np.array([1.0, 0.5, 0.3, 0.2])
    depths, sources = np.array([0, 1, 2, 1]), np.array([0, 1, 3, 2])
    before = ctl.calibration().probability_list(depths, parents, scores, sources)
    ctl.observe_tree(parents, scores, np.array([1, 2]), depths, sources=sources)
    assert nodes == [(1, 1, before[1], True), (3, 2, before[2], True), (2, 1, before[3], False)]
    assert ctl.calibration().mass[1].sum() == pytest.approx(0.5)  # the budget still observed
    ctl.observe_tree(parents, scores, 1, depths)  # no sources: not recorded
    assert len(nodes) == 3
    table = replay.calibration_table(nodes + [(2, 5, 0.5, True)], deepest=4)
    assert table["memory, all depths"] == {"nodes": 1, "expected": before[1], "accepted": 1,
                                          "ratio": 1 / before[1]}
    assert table["memory + continuation, depth 2"]["accepted"] == 1
    assert table["continuation, all depths"]["nodes"] == 2
    assert table["continuation, depth 4+"] == {"nodes": 1, "expected": 0.5, "accepted": 1,
                                              "ratio": 2.0}
    assert replay.source_name(0) == "untracked"
