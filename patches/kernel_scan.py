"""Seam: keep vLLM's Triton-override scan from crashing once numba is imported.

At worker start vLLM-CPU rebinds Triton kernels by scanning every attribute of every loaded
module and reading ``vars(value)`` of anything that ``hasattr(value, "__dict__")``
(``vllm.triton_utils.dispatcher._rebind_kernels``). llvmlite's library wrapper
(``llvmlite.binding.ffi.lib``, loaded by any numba import) resolves *every* attribute name,
``__dict__`` included, to a C-function wrapper, so the scan dies with "'_lib_fn_wrapper'
object has no attribute 'get'". That happens to any engine started in a process where numba
was imported before: RECAP's core uses numba, and so does vLLM's own n-gram proposer.

Fix at the cause, not in vLLM: dunder names are never C symbols, so the wrapper now raises
AttributeError for them, as ``ctypes.CDLL`` itself does.
"""
from __future__ import annotations

from vllm_recap.patches import fail

SEAM = "llvmlite.binding.ffi._lib_wrapper.__getattr__ (vLLM kernel-override scan)"


def install() -> None:
    try:
        from llvmlite.binding import ffi
    except ImportError:  # no numba/llvmlite installed: nothing to guard
        return
    cls = getattr(ffi, "_lib_wrapper", None)
    original = getattr(cls, "__getattr__", None)
    if original is None:
        raise fail(SEAM, "llvmlite's _lib_wrapper no longer has __getattr__")
    if getattr(original, "__recap_seam__", None) == SEAM:
        return

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return original(self, name)

    __getattr__.__recap_seam__ = SEAM
    cls.__getattr__ = __getattr__
