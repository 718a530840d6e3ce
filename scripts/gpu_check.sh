#!/usr/bin/env bash
# The GPU check kit (issue 27; scripts/gpu_check.py says what each step does, docs/gpu_results.md what came back).
#
#   scripts/gpu_check.sh --prepare   on this (CPU) machine: fill .gpu_kit/ (megatron-core wheels, test models; <= 20 MB)
#   scripts/gpu_check.sh             on the lent GPU machine, as ONE device call carrying .gpu_kit, e.g.
#                                      run(command="scripts/gpu_check.sh", carry=[".gpu_kit"], timeout_s=480)
#                                    writes summary.json, forward_costs.json and logs.tar.gz to $OUT
#   scripts/gpu_check.sh --dry-run   the same steps here, on the CPU (the test suite runs it)
# Extra arguments go to scripts/gpu_check.py run (--out DIR, --deadline-s S).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  --prepare)
    shift
    scripts/setup_env.sh > /dev/null
    exec .venv/bin/python scripts/gpu_check.py prepare "$@" ;;
  --dry-run)
    shift
    PY=${PYTHON:-.venv/bin/python}
    [ -x "$PY" ] || PY=python3
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} exec "$PY" scripts/gpu_check.py run --dry-run "$@" ;;
  *)
    # the GPU machine's python3 holds torch with CUDA; nothing there reaches the network
    exec "${PYTHON:-python3}" scripts/gpu_check.py run "$@" ;;
esac
