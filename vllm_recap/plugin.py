"""vLLM ``general_plugins`` entry point (``recap``).

vLLM calls :func:`register` once in every process it starts (front end, engine core, each
worker), before it builds the speculative config. It must stay cheap; the heavy wiring is
done lazily by :mod:`vllm_recap.vllm`.
"""
from __future__ import annotations

import logging

logger = logging.getLogger("vllm_recap")

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
    """Entry point: check the vLLM version, install the request-path seams, log once.

    The seams act only for engines configured with ``{"method": "recap"}``; the runner and
    attention seams are installed later, by the proposer, in the worker that uses it.
    """
    global _registered
    if _registered:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm_recap.patches import kernel_scan, requests, speculative_method

    kernel_scan.install()  # before the worker's kernel-override scan (see the module)
    speculative_method.install()
    requests.install()
    _registered = True
    logger.info("vllm-recap plugin loaded (vLLM %s)", vllm.__version__)
