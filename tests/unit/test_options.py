"""Translation of {"method": "recap", ...}: defaults, derived num_speculative_tokens, errors."""
from __future__ import annotations

import pytest

from vllm_recap.core.config import RecapConfig
from vllm_recap.vllm import PROPOSER_PATH
from vllm_recap.vllm.options import DEVICE_DEFAULTS, translate

pytestmark = pytest.mark.unit


def test_minimal_config_gets_device_defaults_and_derived_tokens():
    vllm_spec, recap = translate({"method": "recap"}, "cpu")
    assert vllm_spec["method"] == "custom_class" and vllm_spec["model"] == PROPOSER_PATH
    cfg = RecapConfig.from_dict(recap)
    assert cfg.node_budget == DEVICE_DEFAULTS["cpu"]["node_budget"]
    assert vllm_spec["num_speculative_tokens"] == cfg.node_budget + cfg.suffix_len


def test_cuda_default_is_paper_budget():
    _, recap = translate({"method": "recap"}, "cuda")
    assert recap["node_budget"] == 63


def test_user_values_win_over_device_defaults():
    vllm_spec, recap = translate({"method": "recap", "node_budget": 8, "suffix_len": 0}, "cpu")
    assert recap["node_budget"] == 8 and vllm_spec["num_speculative_tokens"] == 8


def test_chain_mode_derives_depth():
    vllm_spec, _ = translate({"method": "recap", "draft_mode": "chain", "max_depth": 6}, "cpu")
    assert vllm_spec["num_speculative_tokens"] == 6


def test_explicit_num_speculative_tokens_is_kept():
    vllm_spec, _ = translate({"method": "recap", "num_speculative_tokens": 5}, "cpu")
    assert vllm_spec["num_speculative_tokens"] == 5


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError, match=r"Unknown key\(s\) \['nodes'\].*Valid keys:.*node_budget"):
        translate({"method": "recap", "nodes": 8})


def test_ngram_only_key_is_rejected_by_name():
    with pytest.raises(ValueError, match=r"Unknown key\(s\) \['prompt_lookup_max'\]"):
        translate({"method": "recap", "prompt_lookup_max": 4})


def test_bad_value_names_field_value_and_range():
    with pytest.raises(ValueError, match=r"top_k = 0 is out of range: must be an int in \[1, 64\]"):
        translate({"method": "recap", "top_k": 0})


def test_bad_enum_names_allowed_values():
    with pytest.raises(ValueError, match=r"draft_mode = 'beam' is invalid: allowed values are"):
        translate({"method": "recap", "draft_mode": "beam"})


@pytest.mark.parametrize("n", [0, -3, 2.5, True, 129])
def test_bad_num_speculative_tokens(n):
    with pytest.raises(ValueError, match=r"num_speculative_tokens = .* must be an int in "
                                         r"\[1, 128\]"):
        translate({"method": "recap", "num_speculative_tokens": n})


def test_node_budget_beyond_vllms_draft_cap_is_refused_at_creation():
    """vLLM asserts at most 128 drafts per request in the middle of serving; refuse first."""
    with pytest.raises(ValueError, match=r"up to \d+ draft tokens .* verifies at most 128"):
        translate({"method": "recap", "node_budget": 200}, "cuda")
    # an explicit cap keeps the larger tree budget usable
    vllm_spec, recap = translate({"method": "recap", "node_budget": 200,
                                  "num_speculative_tokens": 128}, "cuda")
    assert vllm_spec["num_speculative_tokens"] == 128 and recap["node_budget"] == 200


def test_pipeline_parallelism_is_refused_with_a_reason():
    with pytest.raises(ValueError, match=r"does not support pipeline parallelism "
                                         r"\(pipeline_parallel_size = 2\)"):
        translate({"method": "recap"}, "cpu", pipeline_parallel_size=2)


def test_dashes_are_accepted_like_vllm_cli():
    _, recap = translate({"method": "recap", "node-budget": 12})
    assert recap["node_budget"] == 12


def test_prompt_seeding_is_off_by_default_on_cpu_only():
    """A CPU pays an LM-head row per seeded prompt position for ~0.5% fewer passes (see
    DEVICE_DEFAULTS); a device gets the rows almost free. The user's value still wins."""
    assert translate({"method": "recap"}, "cpu")[1]["prompt_seed_rows"] == 0
    assert translate({"method": "recap"}, "cuda")[1]["prompt_seed_rows"] == 256
    _, recap = translate({"method": "recap", "prompt_seed_rows": 64}, "cpu")
    assert recap["prompt_seed_rows"] == 64
