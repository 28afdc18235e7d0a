"""Shared fixtures for the core tests: kernels compiled (or loaded from numba's cache) once."""

from __future__ import annotations

import pytest

from vllm_recap.core import warmup


@pytest.fixture(scope="session", autouse=True)
def _compiled_kernels() -> None:
    # One warm-up for the whole session, so no test pays (or times) numba compilation.
    warmup()
