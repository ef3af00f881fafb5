#!/usr/bin/env bash
# One call on the lent GPU machine (see /work/.library/device) for the depthwise-convolution kernel: build the
# extension in place, its tests (and the model's CUDA tests), compute-sanitizer on small cases, the
# kernel benchmark against cuDNN, then optionally the model benchmark. Logs land in $OUT.
#   bash scripts/gpu_dwconv.sh              (BENCH_ARGS="..." MODELS="..." to add a bench_models.py run)
set -uo pipefail
OUT=${OUT:-/tmp/gspn2_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
t0=$(date +%s)
[[ ${SKIP_BUILD:-0} == 1 ]] || CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 \
  $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; echo BUILD FAILED; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
if [[ ${SKIP_TEST:-0} != 1 ]]; then
  t0=$(date +%s)
  timeout ${PYTEST_TIMEOUT:-240} $PY -m pytest -q -rfE -p no:cacheprovider tests/models/test_dwconv.py ${EXTRA_TESTS:-} \
    -W ignore::DeprecationWarning >"$OUT/pytest_dwconv.log" 2>&1
  echo "pytest rc=$? ($(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/pytest_dwconv.log")"
  grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/pytest_dwconv.log" | head -30
  cat >/tmp/sanitize_dw.py <<'PYEOF'
import os, torch
from gspn2.layers import depthwise_conv2d
os.environ["GSPN2_DWCONV"] = "cuda"
for tile, vec in (("4", "8"), ("4", "4"), ("8", "8"), ("8", "4")):
    os.environ["GSPN2_DWCONV_TILE"], os.environ["GSPN2_DWCONV_VEC"] = tile, vec
    for (B, C, H, W, K, add, dt) in [(1, 16, 9, 13, 7, True, torch.bfloat16), (2, 5, 6, 3, 3, False, torch.float32),
                                     (1, 24, 11, 17, 5, True, torch.float16), (1, 8, 1, 9, 7, False, torch.float32)]:
        x = torch.randn(B, C, H, W, device="cuda", dtype=dt).to(memory_format=torch.channels_last).requires_grad_()
        w = torch.randn(C, 1, K, K, device="cuda", requires_grad=True)
        b = torch.randn(C, device="cuda", requires_grad=True)
        y = depthwise_conv2d(x, w, b, add)
        torch.autograd.grad(y, (x, w, b), torch.randn_like(y))
        with torch.no_grad():
            depthwise_conv2d(x, w, b, silu=True)
torch.cuda.synchronize()
print("sanitize case ok")
PYEOF
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 $PY /tmp/sanitize_dw.py >"$OUT/san_dw_$tool.log" 2>&1
    echo "sanitizer $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize case ok' "$OUT/san_dw_$tool.log" | tr '\n' ' ')"
  done
fi
if [[ ${SKIP_BENCH:-0} != 1 ]]; then
  timeout ${DW_TIMEOUT:-150} $PY scripts/bench_dwconv.py --batch 128 --variants ${VARIANTS:-t4v8 t4v4} --json "$OUT/bench_dwconv.json" \
    2>&1 | tee "$OUT/bench_dwconv.txt"
fi
if [[ -n ${BENCH_ARGS:-} ]]; then
  timeout ${BENCH_TIMEOUT:-300} $PY scripts/bench_models.py --models ${MODELS:-gspn2_tiny swin_tiny_patch4_window7_224 convnext_tiny} \
    $BENCH_ARGS --json "$OUT/bench_models.json" --md "$OUT/bench_models.md" --plot "$OUT/bench_models.png" >"$OUT/bench_models.log" 2>&1
  echo "bench_models rc=$?"; tail -25 "$OUT/bench_models.log"
fi
