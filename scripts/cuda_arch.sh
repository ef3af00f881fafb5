#!/usr/bin/env bash
# Print the CUDA architectures to compile gspn2's extension for, a tab, and why:
#   TORCH_CUDA_ARCH_LIST when set; else the compute capabilities of the GPUs this machine has (through
#   torch); else -- a builder without a GPU, such as CI -- one architecture, 9.0 (H100/H200).
# Usage: bash scripts/cuda_arch.sh [python]   (default .venv/bin/python)
set -euo pipefail
PY=${1:-.venv/bin/python}
if [ -n "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    printf '%s\t%s\n' "$TORCH_CUDA_ARCH_LIST" "TORCH_CUDA_ARCH_LIST"
    exit 0
fi
local_archs=$("$PY" -c "import torch; print(';'.join(sorted({'%d.%d' % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})))" 2>/dev/null || true)
if [ -n "$local_archs" ]; then
    printf '%s\t%s\n' "$local_archs" "this machine's GPU(s)"
else
    printf '%s\t%s\n' "9.0" "no GPU visible: one architecture, H100/H200; set TORCH_CUDA_ARCH_LIST for others"
fi
