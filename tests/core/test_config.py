"""RecapConfig: defaults, dict round trips, and one test per validation error path."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_recap.core import (
    DraftMode,
    FusionMode,
    Policy,
    RecapConfig,
    SharedIndexMode,
    SuffixMode,
    TreeShape,
)
from vllm_recap.core.config import MAX_DEPTH, discount_table

pytestmark = pytest.mark.unit


def test_defaults_are_paper_scale() -> None:
    c = RecapConfig()
    assert (c.top_k, c.max_depth, c.node_budget, c.suffix_len) == (8, 10, 63, 16)
    assert c.priors == (0.70, 0.20, 0.10)
    assert c.depth_discounts == (0.68, 0.63, 0.50, 0.43, 0.40, 0.38)
    assert c.persistent_unigram and c.use_context_memories
    assert c.fusion is FusionMode.PRIORS_ENTROPY
    assert c.policy is Policy.RECAP
    assert c.tree_shape is TreeShape.BEST_FIRST
    assert c.max_context_rows == 8192 and c.max_partitions == 16
    assert c.suffix_min_match == 1 and c.suffix_prior == 0.3


def test_defaults_of_the_evidence_additions() -> None:
    c = RecapConfig()
    assert c.suffix_mode is SuffixMode.EVIDENCE and c.suffix_min_prob == 0.1
    assert c.shared_index is SharedIndexMode.OUTPUTS and c.shared_index_tokens == 32768
    assert c.calibrated_scores is True


def test_all_additions_off_is_the_original_configuration() -> None:
    off = RecapConfig.from_dict({"suffix_mode": "earliest", "shared_index": "OFF",
                                 "calibrated_scores": False, "suffix_len": 4})
    assert off.suffix_mode is SuffixMode.EARLIEST and off.shared_index is SharedIndexMode.OFF
    assert RecapConfig.from_dict(off.to_dict()) == off


def test_discount_table_is_indexed_by_depth_and_repeats_the_last_value() -> None:
    table = discount_table(RecapConfig().depth_discounts)
    assert table.shape == (MAX_DEPTH + 1,) and table.dtype == np.float64
    assert table[[0, 1, 2, 6, 7, 10, MAX_DEPTH]].tolist() == [1.0, 0.68, 0.63, 0.38, 0.38, 0.38,
                                                             0.38]
    assert discount_table((0.5,)).tolist() == [1.0] + [0.5] * MAX_DEPTH
    longest = tuple(1.0 / (d + 1) for d in range(MAX_DEPTH))
    assert discount_table(longest)[1:].tolist() == list(longest)


def test_max_depth_range_is_max_depth() -> None:
    assert RecapConfig(max_depth=MAX_DEPTH).max_depth == MAX_DEPTH == 64
    with pytest.raises(ValueError, match=r"max_depth = 65 is out of range: .* \[1, 64\]"):
        RecapConfig(max_depth=MAX_DEPTH + 1)


def test_dict_round_trip() -> None:
    c = RecapConfig(fusion=FusionMode.UNIFORM, policy=Policy.TOKEN_RECYCLING, node_budget=80,
                    depth_discounts=(0.5, 0.25))
    d = c.to_dict()
    assert d["fusion"] == "uniform" and d["policy"] == "token_recycling"
    assert d["depth_discounts"] == [0.5, 0.25]
    assert RecapConfig.from_dict(d) == c


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("fusion", "uniform", FusionMode.UNIFORM),
        ("fusion", "BACKOFF", FusionMode.BACKOFF),
        ("fusion", "priors_fixed", FusionMode.PRIORS_FIXED),
        ("policy", "token_recycling", Policy.TOKEN_RECYCLING),
        ("policy", "RECAP", Policy.RECAP),
        ("tree_shape", "fixed", TreeShape.FIXED),
        ("draft_mode", "chain", DraftMode.CHAIN),
        ("suffix_mode", "earliest", SuffixMode.EARLIEST),
        ("suffix_mode", "EVIDENCE", SuffixMode.EVIDENCE),
        ("shared_index", "off", SharedIndexMode.OFF),
        ("shared_index", "outputs_and_prompts", SharedIndexMode.OUTPUTS_AND_PROMPTS),
    ],
)
def test_from_dict_accepts_enum_strings(key: str, value: str, expected: object) -> None:
    assert getattr(RecapConfig.from_dict({key: value}), key) is expected


def test_from_dict_lists_become_tuples() -> None:
    c = RecapConfig.from_dict({"priors": [0.5, 0.3, 0.2]})
    assert c.priors == (0.5, 0.3, 0.2)


def test_from_dict_rejects_unknown_keys_listing_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown RecapConfig key\(s\) \['bogus'\].*top_k"):
        RecapConfig.from_dict({"bogus": 1, "top_k": 8})


def test_from_dict_rejects_non_dict() -> None:
    with pytest.raises(ValueError, match="expects a dict, got list"):
        RecapConfig.from_dict([("top_k", 8)])  # type: ignore[arg-type]


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        RecapConfig().top_k = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("top_k", 0, r"top_k = 0 is out of range: must be an int in \[1, 64\]"),
        ("top_k", 65, r"top_k = 65 is out of range"),
        ("top_k", True, r"top_k = True is out of range"),
        ("top_k", 8.0, r"top_k = 8.0 is out of range"),
        ("max_depth", 0, r"max_depth = 0 is out of range: must be an int in \[1, 64\]"),
        ("node_budget", -1, r"node_budget = -1 is out of range: must be an int in \[0, 1024\]"),
        ("node_budget", 1025, r"node_budget = 1025 is out of range"),
        ("suffix_len", -1, r"suffix_len = -1 is out of range: must be an int in \[0, 64\]"),
        ("suffix_min_match", 0, r"suffix_min_match = 0 is out of range"),
        ("suffix_prior", 0.0,
         r"suffix_prior = 0.0 is out of range: must be a float in \(0.0, 1.0\]"),
        ("suffix_prior", 1.5, r"suffix_prior = 1.5 is out of range"),
        ("suffix_prior", float("nan"), r"suffix_prior = nan is out of range"),
        ("priors", (0.7, 0.3),
         r"priors = \(0.7, 0.3\) is out of range: must be 3 floats, each in \(0, 1\]"),
        ("priors", (0.7, 0.2, 0.0), r"priors = \(0.7, 0.2, 0.0\) is out of range"),
        ("priors", "abc", r"priors = 'abc' is out of range"),
        ("depth_discounts", (), r"depth_discounts = \(\) is out of range: must be 1 to 64 floats"),
        ("depth_discounts", (0.5, 1.5), r"depth_discounts = \(0.5, 1.5\) is out of range"),
        ("persistent_unigram", 1, r"persistent_unigram = 1 is invalid: must be a bool"),
        ("use_context_memories", "yes",
         r"use_context_memories = 'yes' is invalid: must be a bool"),
        ("max_context_rows", 15,
         r"max_context_rows = 15 is out of range: must be an int in \[16, 16777216\]"),
        ("max_partitions", 0,
         r"max_partitions = 0 is out of range: must be an int in \[1, 4096\]"),
        ("fusion", "median", r"fusion = 'median' is invalid: allowed values are "
                             r"\['priors_entropy', 'backoff', 'uniform', 'priors_fixed'\]"),
        ("policy", "eagle",
         r"policy = 'eagle' is invalid: allowed values are \['recap', 'token_recycling'\]"),
        ("tree_shape", 3,
         r"tree_shape = 3 is invalid: allowed values are \['best_first', 'fixed'\]"),
        ("draft_mode", "beam",
         r"draft_mode = 'beam' is invalid: allowed values are \['tree', 'chain'\]"),
        ("prompt_seed_rows", -1,
         r"prompt_seed_rows = -1 is out of range: must be an int in \[0, 65536\]"),
        ("batch_node_budget", -5,
         r"batch_node_budget = -5 is out of range: must be an int in \[0, 1048576\]"),
        ("suffix_min_prob", -0.1,
         r"suffix_min_prob = -0.1 is out of range: must be a float in \[0.0, 1.0\]"),
        ("suffix_min_prob", 1.01, r"suffix_min_prob = 1.01 is out of range"),
        ("suffix_min_prob", True, r"suffix_min_prob = True is out of range"),
        ("suffix_mode", "latest",
         r"suffix_mode = 'latest' is invalid: allowed values are \['evidence', 'earliest'\]"),
        ("shared_index", True, r"shared_index = True is invalid: allowed values are "
                               r"\['outputs', 'outputs_and_prompts', 'off'\]"),
        ("shared_index_tokens", 63,
         r"shared_index_tokens = 63 is out of range: must be an int in \[64, 16777216\]"),
        ("shared_index_tokens", 2.0, r"shared_index_tokens = 2.0 is out of range"),
        ("calibrated_scores", "yes", r"calibrated_scores = 'yes' is invalid: must be a bool"),
        ("calibrated_scores", 0, r"calibrated_scores = 0 is invalid: must be a bool"),
    ],
)
def test_each_invalid_field_names_field_value_and_range(field: str, value: object,
                                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RecapConfig(**{field: value})
    with pytest.raises(ValueError, match=message):
        RecapConfig.from_dict({field: value})
