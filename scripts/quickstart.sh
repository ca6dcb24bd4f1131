#!/usr/bin/env bash
# CPU quickstart, end to end on a tiny model: install; write a tiny random GLM-5.3 checkpoint in the released FP8
# layout (with the MTP layer); run it (packed multimodal row: forward, loss + MTP loss, backward); convert it to a
# megatron-core distributed checkpoint; fine-tune it a few steps with pretrain_glm5_vlm.py on generated packed
# image+text data (TensorBoard events under OUT/tensorboard); export the trained checkpoint back to HF.
# Everything runs in the Python >= 3.12 virtual environment of scripts/python_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
out=${QUICKSTART_DIR:-outputs/quickstart}
# start afresh, but delete only a folder the quickstart made itself (it carries a .quickstart marker)
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ] && [ ! -e "$out/.quickstart" ]; then
    echo "quickstart: error: $out exists and was not made by the quickstart; set QUICKSTART_DIR to a new folder" >&2
    exit 2
fi
rm -rf "$out"
mkdir -p "$out"
touch "$out/.quickstart"
"$PY" tools/make_tiny_hf_checkpoint.py --out "$out/tiny_hf" --format fp8 --mtp
"$PY" scripts/quickstart.py --hf-dir "$out/tiny_hf" --out "$out" --steps 1
"$PY" tools/convert_hf_to_mcore.py --hf-dir "$out/tiny_hf" --out "$out/tiny_mcore" --dtype fp32 --tp 2 --ep 2
"$PY" tools/make_tiny_data.py --out "$out/data" --text-docs 50 --vqa-docs 12
"$PY" pretrain_glm5_vlm.py --hf-config "$out/tiny_hf" --pretrained-checkpoint "$out/tiny_mcore" \
    --dataset-type vqa --data-path "$out/data/vqa/vqa.jsonl" --tokenizer-model "$out/data" --split 1,0,0 \
    --seq-length 96 --micro-batch-size 1 --global-batch-size 2 --train-iters 6 --lr 5e-3 --lr-warmup-iters 1 \
    --moe-aux-loss-coeff 1e-3 --eval-iters 0 --save "$out/checkpoints" --save-interval 6 --tensorboard-dir "$out/tensorboard" --log-interval 2
"$PY" tools/convert_mcore_to_hf.py --load "$out/checkpoints" --hf-assets "$out/tiny_hf" --out "$out/tiny_hf_trained"
echo "quickstart: done; TensorBoard events in $out/tensorboard, trained model in $out/tiny_hf_trained"
