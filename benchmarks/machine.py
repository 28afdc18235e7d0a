"""What a benchmark result must say about where it ran: machine, libraries, dtype, suffix build."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

LIBRARIES = ("vllm", "torch", "transformers", "numpy", "numba", "arctic-inference", "vllm-recap")
SUFFIX_BUILD_DOC = "benchmarks/SUFFIX_BUILD.md"


def resolve_dtype(name: str) -> str:
    """``auto`` -> bfloat16 where the CPU has native bf16 matmuls (AVX-512 BF16), else float32.

    Without AVX-512 BF16, bf16 matmuls are emulated and cost about linearly in rows, so fp32 is
    faster here even without speculation, and fp32 is exact for the losslessness check (bf16
    flips near-tie argmaxes between chain and one-token decoding; see docs/cpu_env.md).
    """
    if name != "auto":
        return name
    import torch

    native_bf16 = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    return "bfloat16" if native_bf16 else "float32"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags() -> list[str]:
    """The SIMD flags that decide speed here (AVX2, AVX-512 F / BF16, AMX)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    return [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]


def cpu_line() -> str:
    """The CPU's model and AVX flags in one line, as the profiling scripts print it."""
    return f"{cpu_model()} ({', '.join(f for f in cpu_flags() if f.startswith('avx'))})"


def library_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision(repo: Path) -> str | None:
    """``<commit>[+dirty]`` of the checkout the benchmark ran from, None outside git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True,
                                capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               text=True, capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}+dirty" if commit and dirty else (commit or None)


def machine_info() -> dict:
    """Platform, CPU model and count, memory, load average, Python and library versions."""
    try:
        mem_kb = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                      if ln.startswith("MemTotal"))
    except (OSError, StopIteration, ValueError):
        mem_kb = 0
    return {
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "cpus": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
        "libraries": library_versions(),
        "git": git_revision(Path(__file__).resolve().parents[1]),
    }


def suffix_status() -> dict:
    """Whether vLLM's suffix method can run here: arctic-inference importable, or why not.

    arctic-inference ships only as a source package; scripts/setup_env.sh builds it (see
    benchmarks/SUFFIX_BUILD.md). The import is what vLLM itself checks.
    """
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure is the reason to report
        return {"available": False,
                "line": f"vLLM suffix decoding unavailable: arctic-inference does not import "
                        f"({type(exc).__name__}: {exc}); build steps and known failures: "
                        f"{SUFFIX_BUILD_DOC}"}
    version = library_versions().get("arctic-inference")
    return {"available": True,
            "line": f"vLLM suffix decoding: arctic-inference {version} built from its source "
                    f"package by scripts/setup_env.sh (CPU suffix tree, no CUDA ops; "
                    f"{SUFFIX_BUILD_DOC}); imports fine"}
