"""benchmarks.seeded_repeat counts the seeded sampled outputs that repeat in a fresh engine."""
from __future__ import annotations

import json

import pytest

from benchmarks import seeded_repeat

pytestmark = pytest.mark.engine


def test_no_speculation_repeats_every_seeded_output(capsys, tmp_path):
    """vLLM without speculation draws each token from the request's generator alone: every
    output repeats (the reference row of the script's table); the batched row compares
    the same requests sent in one batch against it."""
    seeded_repeat.main(["--configs", "none-batched,none", "--prompts", "2",
                        "--max-new-tokens", "8", "--out", str(tmp_path / "repeat.json")])
    assert ("none: 2 of 2 outputs identical run to run, [2, 2] equal to none's in each run"
            in capsys.readouterr().out)
    saved = json.loads((tmp_path / "repeat.json").read_text())
    assert saved["rows"][0] == {"config": "none", "spec": None, "identical": 2, "prompts": 2,
                                "as_none": [2, 2]}
    batched = saved["rows"][1]
    assert batched["config"] == "none-batched" and batched["prompts"] == 2
    assert batched["identical"] == 2 and len(batched["as_none"]) == 2
    assert saved["sampling"] == "qwen_text"


def test_an_unknown_config_is_named(capsys):
    with pytest.raises(SystemExit):
        seeded_repeat.main(["--configs", "recap,recap-fast"])
    assert "recap-fast" in capsys.readouterr().err


def test_a_setting_that_does_not_sample_is_refused(capsys):
    with pytest.raises(SystemExit):
        seeded_repeat.main(["--sampling", "qwen_vl"])
    assert "qwen_vl" in capsys.readouterr().err
