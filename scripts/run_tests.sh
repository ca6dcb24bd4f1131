#!/usr/bin/env bash
# Install megatron_glm5 with its pinned dependencies (CPU torch), lint with ruff (ruff.toml; the same check as the
# pre-commit hook) and run the test suite.
# Usage: bash scripts/run_tests.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[test]"
python3 -m pip install -q ruff==0.17.6
python3 -m ruff check .
python3 -m pytest -q -m "not slow" "$@"
