#!/usr/bin/env bash
# GLM-5.3-Flash on one node of 8 GPUs (torchrun, NCCL).
#
# The released model (320B total, 18B active; 45 decoder layers + 1 MTP layer, 288 experts top-8) does not fit
# one node for full training: bf16 weights + fp32 grads + fp32 master + Adam states are ~18 bytes per parameter
# (~5.8 TB) even when fully sharded. One node is for a shortened model (--num-layers N) to validate a setup, or for
# debugging. The recommended layout of the full model is in pretrain_glm5_flash_slurm.sh.
#
#   bash examples/pretrain_glm5_flash_1node.sh DATA_PREFIX TOKENIZER_DIR OUT_DIR
#   DRY_RUN=1 bash examples/pretrain_glm5_flash_1node.sh ...   # check the flags on any machine, no GPUs
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:?indexed data prefix (tools/preprocess_data.py output)}; TOK=${2:?tokenizer dir}; OUT=${3:-outputs/flash_1node}
PY=${PYTHON:-python}

ARGS=(
    --model-preset glm5-flash --num-layers 8
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
    --use-distributed-optimizer --bf16
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --data-path "$DATA" --tokenizer-model "$TOK" --split 969,30,1
    --seq-length 4096 --micro-batch-size 1 --global-batch-size 64
    --train-iters 1000 --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters 100
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    --moe-aux-loss-coeff 1e-4 --moe-router-bias-update-rate 1e-3
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.3
    --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 200 --exit-signal-handler
    --eval-interval 200 --eval-iters 10
    --tensorboard-dir "$OUT/tensorboard" --log-interval 10 --log-throughput
)
if [ -n "${DRY_RUN:-}" ]; then  # Megatron-LM's argument checks and ours, for a world of 8 ranks
    exec env WORLD_SIZE=8 RANK=0 LOCAL_RANK=0 MEGATRON_GLM5_CHECK_ARGS=1 "$PY" pretrain_glm5_vlm.py "${ARGS[@]}"
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP / CP communication ordering (Megatron-LM, Hopper)
torchrun --nproc-per-node 8 --nnodes 1 --standalone pretrain_glm5_vlm.py "${ARGS[@]}"
