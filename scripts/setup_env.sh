#!/usr/bin/env bash
# Create .venv in the repository root and install gspn2 with its pinned dependencies.
# Idempotent: a second run only re-checks. The CUDA extension is compiled when nvcc is found
# (CUDA_HOME, else /usr/local/cuda); set GSPN2_BUILD_CUDA=0 to skip it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install -q -c requirements/constraints.txt "setuptools>=69" wheel ninja
# torch first: the extension's build (no build isolation) imports it.
"${PIP[@]}" install -q -c requirements/constraints.txt torch torchvision
"${PIP[@]}" install -q -c requirements/constraints.txt --no-build-isolation -e ".[test]"
.venv/bin/python -c "import gspn2, torch; print(f'gspn2 {gspn2.__version__} ready (torch {torch.__version__})')"
