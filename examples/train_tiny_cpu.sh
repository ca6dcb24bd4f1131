#!/usr/bin/env bash
# Train the tiny GLM-5.3 model on CPU (one process, gloo) on a generated corpus, with TensorBoard logs and a
# resumable checkpoint. Runs in a couple of minutes on 2 cores (in the environment of scripts/python_env.sh:
# source .venv/bin/activate, or PYTHON=.venv/bin/python).
#
#   bash examples/train_tiny_cpu.sh [OUT_DIR] [--extra pretrain flags]
#
# Then: tensorboard --logdir OUT_DIR/tensorboard
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/tiny_cpu}
shift || true
mkdir -p "$OUT"
PY=${PYTHON:-python}
[ -f "$OUT/data/tokenizer.json" ] || "$PY" tools/make_tiny_data.py --out "$OUT/data" --text-docs 200 --vqa-docs 16

# --model-preset glm5-tiny: 4 layers (KDA, DSA, dense MLP, MoE with 8 experts top-2), 3 mHC streams, a 2-block
# vision tower and one MTP layer. Every flag is Megatron-LM's; `python pretrain_glm5_vlm.py --help` lists them.
# Running it again resumes from its last checkpoint (--load).
"$PY" pretrain_glm5_vlm.py \
    --model-preset glm5-tiny \
    --data-path "$OUT/data/text_text_document" --tokenizer-model "$OUT/data" --split 98,2,0 \
    --seq-length 64 --micro-batch-size 2 --global-batch-size 4 \
    --train-iters 20 --lr 1e-2 --min-lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 2 \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 \
    --moe-aux-loss-coeff 1e-3 --moe-router-bias-update-rate 1e-3 --mtp-loss-scaling-factor 0.1 \
    --eval-interval 10 --eval-iters 1 \
    --save "$OUT/checkpoints" --save-interval 10 --load "$OUT/checkpoints" \
    --tensorboard-dir "$OUT/tensorboard" --log-interval 5 "$@"
