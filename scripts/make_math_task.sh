#!/usr/bin/env bash
# Generate the public math task (DeepMind's mathematics_dataset) as JSONL: docs/demo.md, "The math task".
# The generator needs sympy 1.5.1, which torch's sympy requirement excludes from .venv, so it gets
# a small environment of its own, .venv-mathds (requirements/mathds.txt; ignored by git). Writes
# $MATH_TASK_DIR/<module>/<split>.jsonl (default runs/math_task) with question/answer columns;
# a second call with the same settings does nothing.
#   MATH_MODULES  comma-separated modules (default numbers__place_value,arithmetic__add_or_sub,
#                 numbers__gcd,algebra__linear_1d)
#   MATH_SPLITS   default train-easy,interpolate,extrapolate (extrapolate where a module has one)
#   MATH_NUM_TRAIN / MATH_NUM_TEST  problems per module and split (default 4000 / 500)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
V=.venv-mathds
stamp=$V/.requirements-stamp
want=$(sha256sum requirements/mathds.txt | cut -d' ' -f1)
if [ ! -x "$V/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[math-task] creating $V (mathematics_dataset with sympy 1.5.1, requirements/mathds.txt)"
  "$PYTHON" -m venv "$V"
  "$V/bin/pip" install -q -r requirements/mathds.txt
  echo "$want" > "$stamp"
fi
OUT=${MATH_TASK_DIR:-runs/math_task}
MODULES=${MATH_MODULES:-numbers__place_value,arithmetic__add_or_sub,numbers__gcd,algebra__linear_1d}
SPLITS=${MATH_SPLITS:-train-easy,interpolate,extrapolate}
NTRAIN=${MATH_NUM_TRAIN:-4000}
NTEST=${MATH_NUM_TEST:-500}
args="--modules $MODULES --splits $SPLITS --num-train $NTRAIN --num-test $NTEST --seed ${MATH_SEED:-0}"
key=$(echo "$args $(sha256sum scripts/mathds_generate.py requirements/mathds.txt)" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$OUT/.stamp" 2>/dev/null)" = "$key" ]; then
  echo "[math-task] $OUT is up to date"
  exit 0
fi
mkdir -p "$OUT"
"$V/bin/python" scripts/mathds_generate.py --out "$OUT" $args
echo "$key" > "$OUT/.stamp"
