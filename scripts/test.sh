#!/usr/bin/env bash
# Set up the environment and run the whole test suite (CPU; GPU tests skip with a reason).
# Extra arguments go to pytest, e.g. scripts/test.sh -k spec -x
#
# scripts/test.sh --fast [pytest args]: the fast lane, everything but the multi-process (dist),
# statistical, slow (> ~30 s) and network tests, on TEST_WORKERS workers, with the test models made
# once into .cache/test_models: under 5 minutes, for the edit-test loop. The full suite (no
# arguments) is the README's command and CI's.
#
# With no arguments the suite runs on TEST_WORKERS pytest-xdist workers (default 2; 0 runs it in this
# process), each file on one worker: much of a test's time is a subprocess starting, importing torch
# and megatron-core, or waiting on a rendezvous, which the other worker fills (on 2 cores, 2 workers
# beat both one process and 3 workers).
# With no arguments, on a CPU with native bf16 the engine, rollout and kernel tests (not the statistical
# ones, below) then run a second time, on the same workers, with MEGATRON_SPEC_NO_NATIVE_BF16=1: the path a
# CPU without AVX-512 takes (fp32 engine, AVX2 kernels). On a CPU without native bf16 the first run already
# took that path.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh --with-sglang --with-vllm
. .venv/bin/activate
# the vLLM backend's tests run against vLLM itself (.venv-vllm, made above): a missing environment fails them
export MEGATRON_SPEC_REQUIRE_VLLM=${MEGATRON_SPEC_REQUIRE_VLLM:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# Two workers of 2 threads each (and their subprocesses) share 2 cores: OpenMP threads that spin while
# waiting steal the cores the other worker's threads need. Sleeping instead: the real model's sampled
# test, two copies at once, 232 s each spinning, 74 s each sleeping (49 s alone). For the tests only: a
# process alone on the cores decodes slower sleeping (the real model's engine, fp32: 11 vs 21 tokens/s at
# batch 1, 103 vs 131 at batch 16), so the product and the benchmarks leave OpenMP's default.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# every run below on the same pytest-xdist workers, each file on one worker
WORKERS=(-n "${TEST_WORKERS:-2}" --dist loadfile)

# The engine, rollout and kernel tests: whatever behaves differently with and without native bf16. The
# second run leaves out the statistical tests: they pin the engine to fp32 (their oracle is the fp32 target),
# so the switch changes only which kernel variant runs (AVX2 instead of AVX-512), and tests/ops checks every
# variant bit for bit against its pure-PyTorch reference in both runs. On 2 workers and without the
# statistical tests the second run takes about a quarter of the set's time in one process.
NO_NATIVE_BF16_TESTS=(
    tests/test_isa.py
    tests/ops
    tests/rollout
    tests/speculative
    tests/sync/test_streamer.py
    tests/sync/test_fingerprint.py
    tests/draft/test_eagle3_head.py
    tests/draft/test_online_acceptance.py
)

# the lint (pyproject.toml [tool.ruff]: line length 110, pycodestyle, pyflakes, isort, pyupgrade, bugbear),
# in both lanes, before any test: a second or two
lint() { echo "[test] ruff check"; ruff check --quiet . && echo "[test] ruff: clean"; }

# The full suite writes GBs into pytest's temporary folder (the real-model GRPO runs' checkpoints, ~2 GB each,
# removed as their tests pass; the CUDA build test's torch). Said first, so that a disk that runs out reads
# as that and not as the tests that happened to write last ('No space left on device', seen in CI once the
# disk was nearly full).
DISK_NEEDED_GB=12
disk_room() {
    local tmp free
    tmp=$(python -c "import tempfile; print(tempfile.gettempdir())")
    free=$(df -Pk "$tmp" | awk 'NR == 2 {print int($4 / 1048576)}')
    echo "[test] $free GB free in $tmp"
    if [ "$free" -lt "$DISK_NEEDED_GB" ]; then
        echo "[test] WARNING: the suite needs about $DISK_NEEDED_GB GB free there at its peak; tests that write" \
             "checkpoints may fail with 'No space left on device' (free some, or point TMPDIR elsewhere)"
    fi
}

if [ "${1:-}" = "--fast" ]; then
    shift
    lint
    # the session's test models (a target, its ModelOpt EAGLE-3 draft, ...: deterministic) made once and
    # kept in the ignored cache, keyed by what makes them; the full suite makes them afresh
    key=$(cat tests/model_factory.py megatron_spec/models/tiny.py megatron_spec/draft/modelopt_train.py \
          requirements/cpu.txt | sha256sum | cut -c1-12)
    models=.cache/test_models/$key
    if [ ! -f "$models/setup.json" ]; then
        echo "[test] making the test models once into $models"
        python -m tests.model_factory "$models" > /dev/null
    fi
    export MEGATRON_SPEC_TEST_MODELS=$PWD/$models
    exec python -m pytest -q "${WORKERS[@]}" --durations=10 \
        -m "not dist and not statistical and not slow and not network and not gpu and not vllm" "$@"
fi
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q --durations=15 "$@"
fi

status=0
disk_room
lint || status=$?
python -m pytest -q "${WORKERS[@]}" --durations=15 || status=$?

if python -c "import sys; from megatron_spec import isa; sys.exit(0 if isa.probe().native_bf16 else 1)"; then
    echo
    echo "[test] again with MEGATRON_SPEC_NO_NATIVE_BF16=1: the engine, rollout and kernel tests (not the statistical ones) on the path of a CPU without native bf16"
    MEGATRON_SPEC_NO_NATIVE_BF16=1 python -m pytest -q "${WORKERS[@]}" --durations=5 \
        -m "not statistical and not vllm" "${NO_NATIVE_BF16_TESTS[@]}" || status=$?
else
    echo
    echo "[test] this CPU runs without native bf16 ($(python -c "from megatron_spec import isa; print(isa.probe().why_not_bf16())")): the run above took that path"
fi
exit "$status"
