#!/usr/bin/env bash
# The second CPU demo (docs/demo.md, "The math task"): GRPO on a public task written by nobody
# here, DeepMind's mathematics_dataset, with the math-verify reward.
#   1. generate the problems as JSONL in their own environment (scripts/make_math_task.sh)
#   2. SFT a small base policy on the train-easy split's answers (launch/sft_base.py --data)
#   3. GRPO (launch/pretrain_grpo_spec.py --config launch/configs/math.yaml) on the train-hard
#      split's questions (longer numbers than SFT saw), the held-out reward on the interpolate
#      split before training, every 10 steps and after the last
#   4. plots and a summary (megatron-spec report)
# MATH_MODULE picks the module (default numbers__place_value); artifacts go to $RUN_DIR
# (default runs/demo_math); steps 1-2 are reused when already there.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
MODULE=${MATH_MODULE:-numbers__place_value}
TASK=${MATH_TASK_DIR:-runs/math_task}
MATH_MODULES=$MODULE MATH_TASK_DIR=$TASK MATH_NUM_TRAIN=${MATH_NUM_TRAIN:-30000} \
    MATH_SPLITS=train-easy,train-hard,interpolate,extrapolate scripts/make_math_task.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
RUN=${RUN_DIR:-runs/demo_math}
mkdir -p "$RUN"
t0=$(date +%s)
if [ ! -f "$RUN/base/config.json" ]; then
  python launch/sft_base.py --out "$RUN/base" --data "$TASK/$MODULE/train-easy.jsonl" \
      --eval-data "$TASK/$MODULE/interpolate.jsonl" --prompt-key question --reward math --max-new-tokens 8 \
      --steps "${SFT_STEPS:-1500}" --batch-size 64 --hidden-size 128 --intermediate-size 384 --num-layers 4 \
      --num-attention-heads 4 --num-kv-heads 2 --eval-prompts 500
fi
rm -rf "$RUN/grpo"
torchrun --nproc_per_node 1 --master_port "${MASTER_PORT:-29410}" launch/pretrain_grpo_spec.py \
    --config launch/configs/math.yaml --hf-checkpoint "$RUN/base" \
    --prompt-data "$TASK/$MODULE/train-hard.jsonl" --eval-data "$TASK/$MODULE/interpolate.jsonl" \
    --train-iters "${GRPO_STEPS:-60}" --save "$RUN/grpo"
python -m megatron_spec report "$RUN/grpo"
echo
cat "$RUN/grpo/report/summary.md"
echo "math demo finished in $(( $(date +%s) - t0 )) s (plots in $RUN/grpo/report/)"
