#!/usr/bin/env bash
# GLM-5.3-Flash pretraining across nodes with Slurm: one srun task per node, each starting torchrun with a c10d
# rendezvous on the first node.
#
#   sbatch --nodes 8 --gpus-per-node 8 examples/pretrain_glm5_flash_slurm.sh DATA_PREFIX TOKENIZER_DIR OUT_DIR
#
# Recommended starting layout for the released model on 64 H200 (8 nodes), 4K context:
#   PP 4 with uneven stages (12 / 12 / 12 / 9 decoder layers: the last stage also holds the MTP layer and the loss),
#   EP 16 (288 experts -> 18 per rank), ETP 1, TP 1, DP 16, distributed optimizer, full recompute.
#   Per GPU: ~5B expert + ~2B dense parameters -> bf16 weights + fp32 grads ~42 GB, Adam + fp32 master ~60 GB
#   (experts are not data-parallel at this layout, so their optimizer state is not sharded): ~100 GB before
#   activations. On 80 GB H100s use 128 GPUs with EP 32. 128K context adds CP 8 (packed, contiguous).
#SBATCH --job-name=glm5-flash
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
DATA=${1:?indexed data prefix}; TOK=${2:?tokenizer dir}; OUT=${3:-outputs/flash}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
GPUS=${GPUS_PER_NODE:-8}

srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" --rdzv-id "$SLURM_JOB_ID" \
    pretrain_glm5_vlm.py \
    --model-preset glm5-flash \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 \
    --decoder-first-pipeline-num-layers 12 --decoder-last-pipeline-num-layers 9 \
    --expert-model-parallel-size 16 --expert-tensor-parallel-size 1 \
    --use-distributed-optimizer --overlap-grad-reduce --bf16 \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --data-path "$DATA" --tokenizer-model "$TOK" --split 969,30,1 \
    --seq-length 4096 --micro-batch-size 1 --global-batch-size 1024 \
    --train-iters 100000 --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 \
    --moe-aux-loss-coeff 1e-4 --moe-router-bias-update-rate 1e-3 \
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.3 \
    --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 1000 \
    --eval-interval 1000 --eval-iters 20 \
    --tensorboard-dir "$OUT/tensorboard" --log-interval 10
