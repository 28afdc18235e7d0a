"""Seam: ``{"method": "recap", ...}`` in ``LLM(speculative_config=...)`` and ``vllm serve``.

vLLM's SpeculativeConfig has a closed ``method`` literal and forbids unknown keys. Before vLLM
builds it (``EngineArgs.create_speculative_config``, front-end process), a RECAP config is
validated and translated to vLLM's ``custom_class`` method naming our proposer; the RECAP knobs
travel to every worker in ``additional_config["recap"]``.
"""
from __future__ import annotations

from vllm_recap.patches import wrap

SEAM = "EngineArgs.create_speculative_config"


def install(refusal: str | None = None) -> None:
    """Installs the translation; with ``refusal``, a RECAP config raises it instead.

    Args:
        refusal: why RECAP cannot run here (unsupported vLLM, a seam that does not fit).
    """
    from vllm.engine.arg_utils import EngineArgs

    state["refusal"] = refusal

    def make(original):
        def create_speculative_config(self, target_model_config, target_parallel_config):
            spec = self.speculative_config
            if isinstance(spec, dict) and spec.get("method") == "recap":
                if state["refusal"] is not None:
                    raise RuntimeError(state["refusal"])
                from vllm_recap.vllm.options import translate

                device = getattr(getattr(self, "device", None), "type", None) or _platform()
                pp = int(getattr(target_parallel_config, "pipeline_parallel_size", 1) or 1)
                self.speculative_config, recap = translate(spec, device, pp)
                self.additional_config = {**(self.additional_config or {}), "recap": recap}
            return original(self, target_model_config, target_parallel_config)

        return create_speculative_config

    wrap(EngineArgs, "create_speculative_config", SEAM,
         ["self", "target_model_config", "target_parallel_config"], make)
    wrap(EngineArgs, "create_engine_config", BLOCK_SEAM, ["self"], make_engine_config)


BLOCK_SEAM = "EngineArgs.create_engine_config (KV block size of RECAP tree engines on CPU)"
TREE_BLOCK_SIZE = 32


def make_engine_config(original):
    def create_engine_config(self, *args, **kwargs):
        spec = self.speculative_config
        if (isinstance(spec, dict) and spec.get("method") == "recap"
                and spec.get("draft_mode", "tree") == "tree" and self.block_size is None
                and _platform() == "cpu"):
            # CPU tree attention copies each tree path's partial last prefix block into
            # scratch every layer (vllm_recap/vllm/cpu_paths.py): 32-token blocks (the
            # smallest vLLM's CPU kernel supports) make that copy 4x cheaper than the default
            # 128, and plain decoding costs the same. An explicit --block-size wins.
            self.block_size = TREE_BLOCK_SIZE
        return original(self, *args, **kwargs)

    return create_engine_config


# Shared by the installed wrapper (installs are idempotent; a later install may arm a refusal).
state: dict[str, str | None] = {"refusal": None}


def _platform() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"
