#!/usr/bin/env bash
# Set up the environment and run the whole test suite (CPU; GPU tests skip with a reason).
# Extra arguments go to pytest, e.g. scripts/test.sh -k spec -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh --with-sglang
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec python -m pytest -q --durations=15 "$@"
