"""vLLM ``general_plugins`` entry point (``recap``).

vLLM calls :func:`register` once in every process it starts (front end, engine core, each
worker), before it builds the speculative config. It must stay cheap; the heavy wiring is
done lazily by :mod:`vllm_recap.vllm`.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("vllm.recap")

# vLLM releases whose internals the seams in patches/ were written against.
SUPPORTED_VLLM = ("0.32.", "0.33.")

_registered = False


def check_vllm_version(version: str) -> None:
    """Raise RuntimeError naming ``version`` when it is not one the seams were written for."""
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"vllm-recap supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; the installed "
            f"vLLM is {version}. Install a supported release (pip install 'vllm-recap[cpu]' or "
            f"'vllm-recap[cuda]')."
        )


def register() -> None:
    """Entry point: install the request-path seams and log once per process.

    The plugin loads in every vLLM process, including engines that never use RECAP, so it
    must not break them: with a vLLM release the seams were not written for it only arms the
    method translation to refuse ``{"method": "recap"}`` with a message naming the version
    (and logs a warning), and a seam that does not fit is reported the same way. The seams
    act only for engines configured with RECAP; the runner and attention seams are installed
    later, by the proposer, in the worker that uses it.
    """
    global _registered
    if _registered:
        return
    _registered = True
    import vllm

    from vllm_recap.patches import (
        SeamError,
        kernel_scan,
        requests,
        scratch_blocks,
        speculative_method,
    )

    version = vllm.__version__
    try:
        check_vllm_version(version)
    except RuntimeError as exc:
        logger.warning("%s {'method': 'recap'} will be refused.", exc)
        speculative_method.install(refusal=str(exc))
        return
    try:
        kernel_scan.install()  # before the worker's kernel-override scan (see the module)
        speculative_method.install()
        requests.install()
        scratch_blocks.install()
    except SeamError as exc:
        logger.warning("%s {'method': 'recap'} will be refused.", exc)
        speculative_method.install(refusal=str(exc))
        return
    logger.info("vllm-recap plugin loaded (vLLM %s)", version)
