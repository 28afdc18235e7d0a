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


def test_unsupported_vllm_keeps_vllm_working_and_refuses_recap(monkeypatch):
    """The plugin loads in every vLLM process: an unsupported release must not break engines
    that do not use RECAP, and a RECAP config must fail with the version in the message."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    from vllm_recap import plugin
    from vllm_recap.patches import speculative_method

    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setitem(speculative_method.state, "refusal", None)
    plugin.register()  # does not raise

    def engine_args(spec):  # only the fields create_speculative_config reads (no model lookup)
        args = object.__new__(EngineArgs)
        args.speculative_config, args.additional_config = spec, {}
        args.spec_method = args.spec_model = args.spec_tokens = None
        return args

    with pytest.raises(RuntimeError, match="installed vLLM is 0.40.1"):
        engine_args({"method": "recap"}).create_speculative_config(None, None)
    assert engine_args(None).create_speculative_config(None, None) is None  # others unaffected


def test_seam_that_does_not_fit_names_seam_and_version():
    from vllm_recap.patches import SeamError, target

    class Owner:
        def method(self, a, b):
            return a

    with pytest.raises(SeamError, match=r"seam 'Owner.method' does not fit the installed vLLM "
                                        r"0\.32.*no longer takes \('self', 'x'\)"):
        target(Owner, "method", "Owner.method", ["self", "x"])
    with pytest.raises(SeamError, match="Owner.gone does not exist"):
        target(Owner, "gone", "Owner.gone")
