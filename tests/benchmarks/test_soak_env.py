"""The soak's servers run with an allocator that gives freed large buffers back to the OS.

The soak's memory check compares idle RSS between rounds. Under glibc's default, freeing a
large mmapped buffer raises the mmap threshold to its size, so the next buffers of that size
come from the heap, and a heap chunk with anything allocated above it stays resident after it
is freed: idle RSS then moves in steps of the largest transient tensors (~20-28 MiB for a
128-row logits tensor of SmolLM2), up or down, by which round first had such a step. That is
what failed CI once (+80 MiB over two rounds for RECAP, +3.5 MiB for the reference, the same
code green the run before). The soak pins the thresholds, so freed buffers leave RSS and a
leak shows as growth.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from benchmarks.soak import server_env

pytestmark = pytest.mark.unit

# A freed 24 MiB buffer, then four more of that size each with a small allocation made after
# it (the pattern of a forward pass: a large transient tensor, small ones that outlive it).
SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import psutil

    def rss():
        return psutil.Process().memory_info().rss / 2**20

    big = np.ones(3 * 2**20)  # 24 MiB, mmapped under the default threshold
    del big                   # the default threshold now rises to 24 MiB
    base = rss()
    keep = []
    for _ in range(4):
        big = np.ones(3 * 2**20)
        keep.append(np.ones(4096))  # 32 KiB, allocated after the big buffer
        del big
    print(json.dumps({"retained_mib": rss() - base}))
""")


def _retained_mib(env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["retained_mib"]


def test_soak_servers_return_freed_large_buffers_to_the_os():
    assert _retained_mib(server_env()) < 8.0


def test_the_default_allocator_keeps_them_so_the_test_above_can_fail():
    env = {k: v for k, v in server_env().items() if not k.startswith("MALLOC_")}
    assert _retained_mib(env) > 16.0
