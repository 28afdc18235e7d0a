#!/usr/bin/env bash
# The tests: set up the environment if needed, then run unit and engine tests (CI runs this).
# Extra arguments go to pytest (e.g. -m unit for the fast ones only).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$REPO/scripts/setup_env.sh"
source "$REPO/scripts/env.sh"
cd "$REPO"
exec "${RECAP_VENV:-$REPO/.venv}/bin/python" -m pytest tests -m "unit or engine" "$@"
