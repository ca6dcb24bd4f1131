#!/usr/bin/env bash
# Fine-tune GLM-5.3-Flash on image+text question answering (MedPix-VQA layout: JSONL or WebDataset tar of
# {image, question, answer}) from the released HF checkpoint, then export the result back to HF safetensors.
#
#   bash examples/finetune_vqa.sh HF_DIR VQA_DATA OUT_DIR [NPROC]
#   DRY_RUN=1 bash examples/finetune_vqa.sh ...   # check the flags on any machine, no GPUs (after step 1)
#
# 1. HF (FP8) -> Megatron checkpoint (layout-free: loads at any TP/PP/EP).
# 2. Packed SFT: documents packed into --seq-length rows (THD, per-document masks), loss on answer tokens only;
#    the first run starts from the converted weights (--pretrained-checkpoint), the same command resumes.
# 3. The last checkpoint -> HF BF16 (or --fp8) safetensors.
# Full fine-tuning of the released model needs the multi-node layout of pretrain_glm5_flash_slurm.sh (launch step 2
# with that script's torchrun line); --freeze-vision keeps the vision tower fixed.
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?HF checkpoint dir}; DATA=${2:?VQA jsonl / tar / dir}; OUT=${3:-outputs/vqa}; NPROC=${4:-8}
PY=${PYTHON:-python}

[ -d "$OUT/mcore" ] || "$PY" tools/convert_hf_to_mcore.py --hf-dir "$HF" --out "$OUT/mcore" --dtype bf16

ARGS=(
    --hf-config "$HF" --pretrained-checkpoint "$OUT/mcore"
    --dataset-type vqa --data-path "$DATA" --tokenizer-model "$HF" --split 95,5,0
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --expert-model-parallel-size "$NPROC"
    --use-distributed-optimizer --bf16 --freeze-vision
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --seq-length 8192 --micro-batch-size 1 --global-batch-size 32
    --train-iters 2000 --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-iters 50
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
    --moe-router-bias-update-rate 0 --mtp-loss-scaling-factor 0.1
    --save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 500 --exit-signal-handler
    --eval-interval 250 --eval-iters 10 --tensorboard-dir "$OUT/tensorboard" --log-interval 10
)
if [ -n "${DRY_RUN:-}" ]; then  # Megatron-LM's argument checks and ours, for a world of NPROC ranks
    exec env WORLD_SIZE="$NPROC" RANK=0 LOCAL_RANK=0 MEGATRON_GLM5_CHECK_ARGS=1 "$PY" pretrain_glm5_vlm.py "${ARGS[@]}"
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1
torchrun --nproc-per-node "$NPROC" --standalone pretrain_glm5_vlm.py "${ARGS[@]}"

"$PY" tools/convert_mcore_to_hf.py --load "$OUT/checkpoints" --hf-assets "$HF" --out "$OUT/hf_export"
