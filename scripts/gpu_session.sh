#!/usr/bin/env bash
# One call on the lent GPU machine (see /work/.library/device): build the extension in place, run the
# CUDA tests, compute-sanitizer on small cases, then the benchmark. Logs and results land in $OUT.
#   bash scripts/gpu_session.sh [all|test|bench|quick]
set -uo pipefail
MODE=${1:-all}
OUT=${OUT:-/tmp/gspn2_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
PY=${PYTHON:-python3}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -2
} 2>&1

t0=$(date +%s)
[[ ${SKIP_BUILD:-0} == 1 ]] || CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
  $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; echo BUILD FAILED; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"

if [[ $MODE == all || $MODE == test ]]; then
  t0=$(date +%s)
  timeout ${PYTEST_TIMEOUT:-420} $PY -m pytest -q -rfE -p no:cacheprovider tests/ops/test_cuda.py tests/ops/test_build.py \
    -W ignore::DeprecationWarning >"$OUT/pytest.log" 2>&1
  echo "pytest rc=$? ($(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/pytest.log")"
  grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/pytest.log" | head -30
  t0=$(date +%s)
  cat >/tmp/sanitize_case.py <<'PYEOF'
import torch, gspn2
from gspn2.ops import gspn_propagate
for (B, C, H, W, K, chunk, dt) in [(1, 4, 9, 13, 2, 3, torch.float32), (1, 2, 6, 7, 1, None, torch.bfloat16),
                                   (1, 32, 5, 8, 1, None, torch.float16), (1, 1, 3, 40, 1, 4, torch.float32),
                                   (1, 2, 16, 24, 1, 5, torch.bfloat16), (1, 1, 300, 264, 1, 7, torch.float32)]:
    x = torch.randn(B, C, H, W, device="cuda", dtype=dt, requires_grad=True)
    lam = torch.randn(B, 4, C, H, W, device="cuda", dtype=dt, requires_grad=True)
    g = torch.randn(B, 4, 3, K, H, W, device="cuda", dtype=dt, requires_grad=True)
    h = gspn_propagate(x, lam, g, chunk)
    torch.autograd.grad(h, (x, lam, g), torch.randn_like(h))
torch.cuda.synchronize()
print("sanitize case ok")
PYEOF
  for tool in ${SANITIZERS:-memcheck racecheck}; do
    timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --print-limit 20 \
      $PY /tmp/sanitize_case.py >"$OUT/sanitizer_$tool.log" 2>&1
    echo "compute-sanitizer $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | head -2 | tr '\n' ' ')"
  done
  cat >/tmp/sanitize_cluster.py <<'PYEOF'
import os
os.environ["GSPN2_KERNEL"] = "cluster"
import torch, gspn2
from gspn2.ops import gspn_propagate
for (B, C, H, W, K, chunk, dt) in [(1, 2, 40, 32, 1, None, torch.float32), (1, 1, 300, 48, 1, 7, torch.float32),
                                   (1, 4, 37, 32, 2, 3, torch.float32), (1, 2, 40, 32, 2, 5, torch.bfloat16),
                                   (1, 4, 37, 32, 2, 3, torch.float16)]:
    x = torch.randn(B, C, H, W, device="cuda", dtype=dt, requires_grad=True)
    lam = torch.randn(B, 4, C, H, W, device="cuda", dtype=dt, requires_grad=True)
    g = torch.randn(B, 4, 3, K, H, W, device="cuda", dtype=dt, requires_grad=True)
    h = gspn_propagate(x, lam, g, chunk)
    torch.autograd.grad(h, (x, lam, g), torch.randn_like(h))  # the backward on autograd's thread
torch.cuda.synchronize()
print("sanitize cluster case ok")
PYEOF
  for tool in ${SANITIZERS:-memcheck racecheck}; do
    timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool --print-limit 20 $PY /tmp/sanitize_cluster.py \
      >"$OUT/sanitizer_cluster_$tool.log" 2>&1
    echo "compute-sanitizer $tool (cluster kernels, forward + backward) rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_cluster_$tool.log" | head -2 | tr '\n' ' ')"
  done
  echo "sanitizers: $(( $(date +%s) - t0 )) s"
fi

if [[ $MODE == profile ]]; then
  timeout ${PROFILE_TIMEOUT:-200} $PY scripts/gpu_profile.py variants ${PROFILE_SHAPES:-big bigbf sweep1024 m56 m28 s32} 2>&1 | tee "$OUT/variants.txt"
  timeout 240 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section SchedulerStats --section Occupancy --section LaunchStats \
    -k regex:fast_kernel -c 2 $PY scripts/gpu_profile.py run big >"$OUT/ncu_big.txt" 2>&1
  echo "ncu rc=$?"; grep -E "gspn_|Duration|Throughput|Stall|Warp Cycles Per|Issued Warp|Eligible|No Eligible|Achieved Occ|Registers Per|Local Memory|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth" "$OUT/ncu_big.txt" | head -80
fi

if [[ $MODE == all || $MODE == bench || $MODE == quick ]]; then
  t0=$(date +%s)
  QUICK=""; [[ $MODE == quick ]] && QUICK="--quick"
  timeout ${BENCH_TIMEOUT:-400} $PY scripts/bench_op.py --out-dir "$OUT" $QUICK >"$OUT/bench.log" 2>&1
  echo "bench rc=$? ($(( $(date +%s) - t0 )) s)"
  tail -40 "$OUT/bench.log"
fi
