#!/usr/bin/env bash
# GLM-5.3-Flash pretraining across nodes with Slurm: one srun task per node, each starting torchrun with a c10d
# rendezvous on the first node.
#
#   sbatch --nodes 8 --gpus-per-node 8 examples/pretrain_glm5_flash_slurm.sh DATA_PREFIX TOKENIZER_DIR OUT_DIR
#   DRY_RUN=1 NNODES=8 bash examples/pretrain_glm5_flash_slurm.sh ...   # check the flags on any machine, no GPUs
#
# The layout is what `python scripts/plan_layout.py --gpus 64 --gpu h100 --seq-length 4096 --global-batch-size 1024
# --search` ranks first for full fine-tuning of the released model on 64 H100 (8 nodes), 4K context: TP 4 with
# sequence parallelism, PP 8 with two virtual stages per rank (the planner's pipeline layout string: embedding + 2
# layers first, the MTP layer and the loss last), EP 8, ETP 1, DP 2, the distributed optimizer with 16-bit moments and
# gradients (--use-precision-aware-optimizer: Transformer Engine's FusedAdam), half of the optimizer on the host
# (--optimizer-cpu-offload), selective recompute (the mixers' internals); ~63 GB on the fullest stage (an estimate).
# Run the planner again for other GPU counts, context lengths or H200s (--gpu h200).
# Preemption: Slurm's SIGTERM is caught (--exit-signal-handler), a checkpoint saved, and the same script resumes.
#SBATCH --job-name=glm5-flash
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --signal=TERM@120
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
DATA=${1:?indexed data prefix}; TOK=${2:?tokenizer dir}; OUT=${3:-outputs/flash}
GPUS=${GPUS_PER_NODE:-8}
NNODES=${SLURM_NNODES:-${NNODES:-8}}
PY=${PYTHON:-python}

ARGS=(
    --model-preset glm5-flash
    --tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 8
    --pipeline-model-parallel-layout 'Et*2|t*3|t*3|t*3|t*3|t*3|t*3|t*3|t*3|t*3|t*3|t*3|t*3|t*3|t*2|t*2mL'
    --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
    --use-distributed-optimizer --use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype bf16
    --exp-avg-sq-dtype bf16 --optimizer-cpu-offload --optimizer-offload-fraction 0.5 --overlap-cpu-optimizer-d2h-h2d
    --recompute-granularity selective
    --overlap-grad-reduce --bf16
    --data-path "$DATA" --tokenizer-model "$TOK" --split 969,30,1
    --seq-length 4096 --micro-batch-size 1 --global-batch-size 1024
    --train-iters 100000 --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    --moe-aux-loss-coeff 1e-4 --moe-router-bias-update-rate 1e-3
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.3
    --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 1000 --exit-signal-handler
    --eval-interval 1000 --eval-iters 20
    --tensorboard-dir "$OUT/tensorboard" --log-interval 10 --log-throughput
)
if [ -n "${DRY_RUN:-}" ]; then  # Megatron-LM's argument checks and ours, for the world this job would have
    exec env WORLD_SIZE=$((NNODES * GPUS)) RANK=0 LOCAL_RANK=0 MEGATRON_GLM5_CHECK_ARGS=1 "$PY" pretrain_glm5_vlm.py "${ARGS[@]}"
fi
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export CUDA_DEVICE_MAX_CONNECTIONS=1  # TP / CP communication ordering (Megatron-LM, Hopper)
srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$NNODES" --nproc-per-node "$GPUS" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" --rdzv-id "$SLURM_JOB_ID" \
    pretrain_glm5_vlm.py "${ARGS[@]}"
