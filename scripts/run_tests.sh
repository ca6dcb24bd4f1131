#!/usr/bin/env bash
# Install megatron_glm5 with its pinned dependencies into a Python >= 3.12 virtual environment
# (scripts/python_env.sh), lint with ruff (ruff.toml; the same check as the pre-commit hook) and run the test suite
# (every tier: unit, numerics, distributed, e2e, gpu; pytest.ini) over the machine's cores with pytest-xdist (at most
# 2 workers by default: MEGATRON_GLM5_TEST_WORKERS=N to change it). --dist loadgroup: the tests that share a
# module-scoped fixture (tests/conftest.py) run on one worker, so it is built once; --durations keeps the slowest
# visible.
# Usage: bash scripts/run_tests.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
MEGATRON_GLM5_EXTRAS=test
source scripts/python_env.sh
"$PY" -m ruff check .
# FLA (the kernels the GPU tests run, the CPU tests import) in a folder of its own, on the test run's path only:
# in the environment itself, transformers would send Glm5Next's KDA to FLA's Triton kernels on CPU too (no driver)
export MEGATRON_GLM5_TEST_SITE="$venv/test-site"
if [ ! -d "$MEGATRON_GLM5_TEST_SITE/fla" ]; then
    "$PY" -m pip install -q --no-deps --target "$MEGATRON_GLM5_TEST_SITE" flash-linear-attention==0.6.0 \
        fla-core==0.6.0 2>&1 | grep -v "^WARNING: Location" || true
fi
export PYTHONPATH="$MEGATRON_GLM5_TEST_SITE${PYTHONPATH:+:$PYTHONPATH}"
WORKERS=${MEGATRON_GLM5_TEST_WORKERS:-$("$PY" -c 'import os; print(min(2, len(os.sched_getaffinity(0))))')}
"$PY" -m pytest -q -m "not slow" --durations=25 -n "$WORKERS" --dist loadgroup "$@"
