#!/usr/bin/env bash
# Create .venv in the repository root and install gspn2 with its pinned dependencies.
# Idempotent: a second run re-checks the pins and rebuilds only when the sources changed.
# The CUDA extension is compiled when nvcc is found (CUDA_HOME, else /usr/local/cuda);
# set GSPN2_BUILD_CUDA=0 to skip it.
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
# Re-install (and so re-compile the CUDA extension) only when something it depends on changed.
so=$(ls gspn2/_C*.so 2>/dev/null | head -n 1 || true)
if [ -n "$so" ] && "${PIP[@]}" show -q gspn2 pytest >/dev/null 2>&1 \
    && .venv/bin/python -c "import gspn2._C" 2>/dev/null \
    && [ -z "$(find gspn2/csrc setup.py pyproject.toml requirements -newer "$so" -print -quit)" ]; then
    echo "gspn2 and its CUDA extension are up to date ($so)"
else
    "${PIP[@]}" install -q -c requirements/constraints.txt --no-build-isolation -e ".[test]"
fi
.venv/bin/python -c "import gspn2, torch; print(f'gspn2 {gspn2.__version__} ready (torch {torch.__version__})')"
