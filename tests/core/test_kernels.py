"""Compiled kernels: warm-up covers every kernel, and usage never triggers a recompilation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter so other tests' direct kernel calls cannot interfere.
SCRIPT = r"""
import numpy as np
from numba.core.registry import CPUDispatcher
from vllm_recap.core import Drafter, RecapConfig, warmup, _kernels as K

warmup()
entries = {name: f for name, f in vars(K).items()
           if isinstance(f, CPUDispatcher) and not name.startswith("_") and name != "table_bits"}
before = {name: len(f.signatures) for name, f in entries.items()}
missing = [name for name, n in before.items() if n == 0]
assert not missing, f"warmup() did not compile {missing}"

# Inputs in other dtypes and containers must be cast by the Python layer, not recompiled.
d = Drafter(RecapConfig(node_budget=20, suffix_prior=1), 50, blocked_token_ids=np.array([3]))
d.start("a", np.arange(40, dtype=np.int32) % 7,
        prompt_rows=(np.ones((4, 8), np.int32), np.ones((4, 8)), [0, 1, 2, 3]))
for _ in range(3):
    t = d.propose("a", node_budget=np.int64(12), max_depth=np.int32(4))
    n = t.num_nodes
    d.observe("a", t.tokens.astype(np.int32).tolist(), t.parents.astype(np.int16),
              np.ones((n, 8), np.uint16), np.ones((n, 8), np.float16))
    d.commit("a", np.array([5, 6], np.int32))
after = {name: len(f.signatures) for name, f in entries.items()}
assert after == before, (before, after)
print("ok", sorted(entries))
"""


def test_warmup_compiles_everything_and_usage_never_recompiles() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")
