"""The plugin entry point: installed under vllm.general_plugins, version check with a clear error."""
from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from vllm_recap.plugin import check_vllm_version

pytestmark = pytest.mark.unit


def test_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("recap") == "vllm_recap.plugin:register"


@pytest.mark.parametrize("version", ["0.32.0", "0.33.1"])
def test_supported_versions_pass(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0"])
def test_unsupported_version_names_version(version):
    with pytest.raises(RuntimeError, match=f"installed vLLM is {version}"):
        check_vllm_version(version)
