#!/usr/bin/env bash
# The GPU test lane: every test marked `gpu` (kernels, FLA / Triton backends, CUDA graphs, model-level parity) on
# the visible CUDA device. A missing prerequisite fails the lane instead of skipping tests: no CUDA device, or
# `import triton` / `import fla.ops.kda` failing, stops it at the start with one line (exit 1), and a `gpu` test that
# skips anyway is reported as failed (tests/gpu_lane.py). FLA's autotuners are trimmed to GLM5_FLA_TUNE_CONFIGS
# configs (default 2 here; correctness only, see megatron_glm5/kernels/fla_tuning.py).
# Usage: bash scripts/run_gpu_tests.sh [extra pytest args]   (PYTHON=... picks the interpreter, default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD/tests:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GLM5_FLA_TUNE_CONFIGS=${GLM5_FLA_TUNE_CONFIGS:-2}
"$PY" - <<'PY'
import sys
from gpu_lane import missing_prerequisites
missing = missing_prerequisites()
if missing:
    print("run_gpu_tests.sh: error: " + "; ".join(missing), file=sys.stderr)
    sys.exit(1)
PY
exec "$PY" -m pytest -p gpu_lane -m gpu -q -rfEsx "$@"
