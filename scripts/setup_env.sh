#!/usr/bin/env bash
# Create .venv in the repository root and install gspn2 with its pinned dependencies.
# Idempotent: a second run re-checks the pins and rebuilds only when the sources changed.
# The CUDA extension is compiled when nvcc is found (CUDA_HOME, else /usr/local/cuda), for the
# architectures of this machine's GPUs only; without a visible GPU (a CI builder) for one, 9.0
# (H100/H200). TORCH_CUDA_ARCH_LIST="8.0;9.0" picks others; GSPN2_BUILD_CUDA=0 skips the build.
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
    && .venv/bin/python -c "import gspn2._C, xdist" 2>/dev/null \
    && [ -z "$(find gspn2/csrc setup.py pyproject.toml requirements -newer "$so" -print -quit)" ]; then
    echo "gspn2 and its CUDA extension are up to date ($so)"
else
    nvcc=""
    for candidate in "${CUDA_HOME:-}/bin/nvcc" "${CUDA_PATH:-}/bin/nvcc" /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)"; do
        if [ -x "$candidate" ]; then nvcc=$candidate; break; fi
    done
    if [ "${GSPN2_BUILD_CUDA:-1}" = 0 ] || [ -z "$nvcc" ]; then
        echo "gspn2: installing without the CUDA extension ($([ -z "$nvcc" ] && echo "no nvcc found" || echo "GSPN2_BUILD_CUDA=0"))"
        "${PIP[@]}" install -q -c requirements/constraints.txt --no-build-isolation -e ".[test]"
    else
        choice=$(bash scripts/cuda_arch.sh .venv/bin/python)
        TORCH_CUDA_ARCH_LIST=${choice%%$'\t'*}
        why=${choice#*$'\t'}
        export TORCH_CUDA_ARCH_LIST
        jobs=${MAX_JOBS:-$(nproc)}
        n_arch=$(echo "$TORCH_CUDA_ARCH_LIST" | tr ';, ' '\n\n\n' | grep -c .)
        echo "gspn2: compiling the CUDA extension ($(ls gspn2/csrc/*.cpp gspn2/csrc/*.cu | wc -l) C++/CUDA files in gspn2/csrc) with $nvcc"
        echo "gspn2:   for compute capability $TORCH_CUDA_ARCH_LIST ($why), $jobs parallel job(s)"
        echo "gspn2:   this takes minutes: about 5-8 per architecture on 2 cores; progress below"
        log=.venv/gspn2-build.log
        start=$(date +%s)
        # pip -v shows ninja's [k/N] lines; keep those (the file being compiled), the full log goes to $log
        if ! MAX_JOBS=$jobs "${PIP[@]}" install -v -c requirements/constraints.txt --no-build-isolation -e ".[test]" \
            2>&1 | tee "$log" | awk '/^[[:space:]]*\[[0-9]+\/[0-9]+\]/ { f = ""; for (i = 2; i <= NF; i++) if ($i ~ /\.(cu|cpp)$/) { f = $i; break }
                                   n = split(f, parts, "/"); print "gspn2:   " $1 " " (n ? parts[n] : "linking gspn2/_C"); fflush() }'; then
            echo "gspn2: the build failed; the last lines of $log:" >&2
            tail -n 40 "$log" >&2
            exit 1
        fi
        echo "gspn2: CUDA extension built for $n_arch architecture(s) in $(( ($(date +%s) - start) / 60 )) min $(( ($(date +%s) - start) % 60 )) s"
    fi
fi
.venv/bin/python -c "import gspn2, torch; print(f'gspn2 {gspn2.__version__} ready (torch {torch.__version__})')"
