"""The core must import with vLLM and torch unavailable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "vllm_recap" / "core"


def test_core_imports_without_vllm_and_torch() -> None:
    modules = sorted(f"vllm_recap.core.{p.stem}" for p in CORE.glob("*.py") if p.stem != "__init__")
    assert "vllm_recap.core.drafter" in modules and len(modules) >= 10
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"  # None in sys.modules makes `import torch` fail
        "sys.modules['vllm'] = None\n"
        "import importlib\n"
        "import vllm_recap.core\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm') "
        "and sys.modules[m] is not None]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
