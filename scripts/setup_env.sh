#!/usr/bin/env bash
# Create .venv in this repository (if missing), install the pinned CPU stack and this
# package (which builds the C++ extension megatron_spec._C). Idempotent and fast when
# nothing changed. Usage: scripts/setup_env.sh [--with-sglang]
#   --with-sglang  also install sglang's own classes for the CPU contract tests
#                  (sglang with --no-deps plus its small import-time dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1   # cache nothing outside the repo

# A .venv whose creation was interrupted (no pip in it) is made again: with it, the bare `pip` below
# was the system's and the stack went outside the venv.
if [ -d .venv ] && ! .venv/bin/python -m pip --version > /dev/null 2>&1; then
  echo "[setup] .venv is incomplete (no working pip: its creation was interrupted?): making it again"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate

stamp=.venv/.requirements-stamp
want=$(cat requirements/cpu.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing the pinned CPU stack (requirements/cpu.txt)"
  python -m pip install -q --upgrade "pip>=24"
  python -m pip install -q -r requirements/cpu.txt
  echo "$want" > "$stamp"
fi

if [ "${1:-}" = "--with-sglang" ]; then
  sstamp=.venv/.sglang-stamp
  swant=$(cat requirements/sglang-cpu.txt requirements/sglang-cpu-deps.txt | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$sstamp" 2>/dev/null)" != "$swant" ]; then
    echo "[setup] installing sglang's classes for contract tests (--no-deps)"
    python -m pip install -q --no-deps -r requirements/sglang-cpu.txt
    python -m pip install -q -r requirements/sglang-cpu-deps.txt
    echo "$swant" > "$sstamp"
  fi
fi

# the package and its extension: rebuilt when a source of the build changed since the last one
bstamp=.venv/.build-stamp
bwant=$( (cat setup.py pyproject.toml requirements/cpu.txt; find csrc -type f | sort | xargs cat) | sha256sum | cut -d' ' -f1)
if [ "$(cat "$bstamp" 2>/dev/null)" != "$bwant" ] || ! ls megatron_spec/_C*.so > /dev/null 2>&1 \
    || ! python -c "import megatron_spec" 2>/dev/null; then
  echo "[setup] building megatron-spec (C++ extension megatron_spec._C)"
  MAX_JOBS=${MAX_JOBS:-2} python -m pip install -q --no-build-isolation --no-deps -e . 2> .venv/build.log || {
    cat .venv/build.log >&2; exit 1; }
  echo "$bwant" > "$bstamp"
else
  echo "[setup] megatron-spec is built and its sources unchanged (.venv/.build-stamp)"
fi
python -c "import torch, megatron_spec._C" 2>/dev/null && echo "[setup] compiled ops: yes" || echo "[setup] compiled ops: no (pure-PyTorch fallbacks)"
