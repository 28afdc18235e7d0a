"""The README stays true: every knob documented, the CI runs the README's test command."""
from __future__ import annotations

from pathlib import Path

import pytest

from vllm_recap.core.config import RecapConfig
from vllm_recap.vllm.options import DEVICE_DEFAULTS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_every_knob_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    missing = [f for f in RecapConfig.field_names() if f"| `{f}` |" not in readme]
    assert not missing, f"README knob table lacks {missing}"


def test_hardware_dependent_defaults_name_both_devices_in_the_readme():
    """A knob whose default depends on the hardware names both values in its row."""
    rows = {line.split("|")[1].strip(" `"): line for line in
            (ROOT / "README.md").read_text().splitlines() if line.startswith("| `")}
    for device, label in (("cpu", "CPU"), ("cuda", "CUDA")):
        for knob in DEVICE_DEFAULTS["cpu"].keys() | DEVICE_DEFAULTS["cuda"].keys():
            value = DEVICE_DEFAULTS[device].get(knob, getattr(RecapConfig(), knob))
            assert f"{value} on {label}" in rows[knob].split("|")[2], (knob, device)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/test.sh" in readme and "./scripts/main.sh" in readme
    assert "exec ./scripts/test.sh" in ci
