#!/usr/bin/env bash
# The main job: set up the environment if needed, then compare speculative methods side by side
# on the embedded SmolLM2-135M (quick mode of benchmarks/run.py). Extra arguments pass through.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup_env.sh"
source "$REPO/scripts/env.sh"
cd "$REPO"
exec "${RECAP_VENV:-$REPO/.venv}/bin/python" -m benchmarks.run --quick "$@"
