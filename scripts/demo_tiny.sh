#!/usr/bin/env bash
# The tiny demo, the fast path (docs/demo.md, "The tiny demo"): a model trained here from scratch,
# end to end in about 10 minutes:
#   1. SFT a small base policy on a synthetic task with step-by-step answers (launch/sft_base.py;
#      30% of its SFT targets carry a systematic error that GRPO then removes: docs/demo.md)
#   2. train and export its EAGLE-3 draft with NVIDIA ModelOpt (launch/make_draft.py)
#   3. GRPO with speculative rollouts and online draft training (launch/pretrain_grpo_spec.py)
#   4. plots and a summary (megatron-spec report)
# Artifacts go to $RUN_DIR (default runs/demo_tiny); steps 1-2 are reused when already there.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
RUN=${RUN_DIR:-runs/demo_tiny}
mkdir -p "$RUN"
t0=$(date +%s)
if [ ! -f "$RUN/base/config.json" ]; then
  python launch/sft_base.py --out "$RUN/base" --task sum --steps "${SFT_STEPS:-300}" --noisy-frac 0.3
fi
if [ ! -f "$RUN/eagle3/config.json" ]; then
  python launch/make_draft.py --target "$RUN/base" --out "$RUN/eagle3" --task sum --steps "${DRAFT_STEPS:-200}"
fi
rm -rf "$RUN/grpo"
torchrun --nproc_per_node 1 --master_port "${MASTER_PORT:-29400}" launch/pretrain_grpo_spec.py \
    --config launch/configs/demo.yaml --hf-checkpoint "$RUN/base" \
    --spec-draft-kind eagle3 --spec-draft-path "$RUN/eagle3" --spec-online-draft-training \
    --train-iters "${GRPO_STEPS:-40}" --save "$RUN/grpo"
python -m megatron_spec report "$RUN/grpo"
echo
cat "$RUN/grpo/report/summary.md"
echo "tiny demo finished in $(( $(date +%s) - t0 )) s (plots in $RUN/grpo/report/)"
