# Sourced by scripts/run_tests.sh and scripts/quickstart.sh: a Python >= 3.12 virtual environment with the pinned
# stack installed (torch 2.13.0, megatron-core 0.19.2, transformers 5.23.0, this package), its python as $PY.
# Python 3.12+ is looked for on PATH (python3.12, python3.13, python3), then through pyenv. The environment lives in
# $MEGATRON_GLM5_VENV (default: .venv in the repository); an existing one is reused and brought up to date.
# Extra pip requirements: $MEGATRON_GLM5_EXTRAS (e.g. "test").

_is_py312() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; }

find_python312() {
    local cand v
    for cand in python3.12 python3.13 python3; do
        if command -v "$cand" >/dev/null 2>&1 && _is_py312 "$(command -v "$cand")"; then
            command -v "$cand"; return 0
        fi
    done
    if command -v pyenv >/dev/null 2>&1; then
        for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])(\.[0-9]+)?$' | sort -V); do
            cand=$(PYENV_VERSION="$v" pyenv which python3 2>/dev/null) || continue
            if _is_py312 "$cand"; then echo "$cand"; return 0; fi
        done
    fi
    return 1
}

venv=${MEGATRON_GLM5_VENV:-.venv}
if [ ! -x "$venv/bin/python" ] || ! _is_py312 "$venv/bin/python"; then
    base=$(find_python312) || {
        echo "$(basename "$0"): error: Python >= 3.12 not found on PATH or through pyenv (megatron-core 0.19.2 needs it)" >&2
        exit 2
    }
    echo "$(basename "$0"): making $venv with $base"
    rm -rf "$venv"
    "$base" -m venv "$venv"
fi
PY="$venv/bin/python"
"$PY" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
# torch first, pinned: a bare 'torch' requirement would let pip pick another build
"$PY" -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
"$PY" -m pip install -q -e ".${MEGATRON_GLM5_EXTRAS:+[$MEGATRON_GLM5_EXTRAS]}" 2>&1 | grep -v "^WARNING: Location" || true
"$PY" -c 'import megatron.core, megatron.training, torch' || {
    echo "$(basename "$0"): error: the install in $venv is incomplete (see pip's output above)" >&2
    exit 1
}
