#!/usr/bin/env bash
# CPU quickstart, end to end on a tiny model: install; write a tiny random GLM-5.3 checkpoint in the released FP8
# layout (with the MTP layer); run it (packed multimodal row: forward, loss + MTP loss, backward, AdamW steps);
# convert it to a megatron-core distributed checkpoint and export that back to HF.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e .
out=${QUICKSTART_DIR:-outputs/quickstart}
mkdir -p "$out"
# --overwrite replaces only the quickstart's own outputs of an earlier run (each once its new version is complete)
python3 tools/make_tiny_hf_checkpoint.py --out "$out/tiny_hf" --format fp8 --mtp --overwrite
python3 scripts/quickstart.py --hf-dir "$out/tiny_hf" --out "$out"
python3 tools/convert_hf_to_mcore.py --hf-dir "$out/tiny_hf" --out "$out/tiny_mcore" --tp 2 --ep 2 --overwrite
python3 tools/convert_mcore_to_hf.py --load "$out/tiny_mcore" --out "$out/tiny_hf_export" --overwrite
