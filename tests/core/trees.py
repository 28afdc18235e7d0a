"""Hypothesis strategies shared by the core tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


@st.composite
def parents_first_trees(draw: st.DrawFn, max_nodes: int = 24) -> np.ndarray:
    """Random parents arrays with parents[0] == -1 and parents[i] < i."""
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    return np.array(parents, np.int64)


def ancestors(parents: np.ndarray, i: int) -> list[int]:
    """i and all its ancestors, brute force."""
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(int(parents[out[-1]]))
    return out
