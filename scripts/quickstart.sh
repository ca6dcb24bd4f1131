#!/usr/bin/env bash
# Install, write a tiny random GLM-5.3 checkpoint in the released FP8 layout, and run the model on it (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e .
out=${QUICKSTART_DIR:-outputs/quickstart}
mkdir -p "$out"
python3 tools/make_tiny_hf_checkpoint.py --out "$out/tiny_hf" --format fp8 --mtp
python3 scripts/quickstart.py --hf-dir "$out/tiny_hf" --out "$out"
