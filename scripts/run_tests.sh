#!/usr/bin/env bash
# Install megatron_glm5 with its pinned dependencies into a Python >= 3.12 virtual environment
# (scripts/python_env.sh), lint with ruff (ruff.toml; the same check as the pre-commit hook) and run the test suite.
# Usage: bash scripts/run_tests.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
MEGATRON_GLM5_EXTRAS=test
source scripts/python_env.sh
"$PY" -m ruff check .
"$PY" -m pytest -q -m "not slow" --durations=25 "$@"
