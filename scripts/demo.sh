#!/usr/bin/env bash
# Set up the environment and run the main job on this CPU machine.
# (Until the GRPO launcher lands this runs the furthest real thing: an HF checkpoint as a
#  Megatron policy at TP=2 under torchrun, checked against transformers.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
RUN=${RUN_DIR:-runs/demo}
mkdir -p "$RUN"
python -m megatron_spec.models.tiny --out "$RUN/base" --family qwen3 --hidden-size 128 --intermediate-size 384 \
    --num-layers 4 --num-attention-heads 4 --num-kv-heads 2 --max-shard-size 500KB
torchrun --nproc_per_node 2 --master_port "${MASTER_PORT:-29400}" launch/check_policy.py \
    --hf-checkpoint "$RUN/base" --tensor-model-parallel-size 2 --compare-transformers
