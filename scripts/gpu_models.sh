#!/usr/bin/env bash
# One call on the lent 2-GPU machine (see /work/.library/device): build the extension in place, then the
# DDP scaling run (1 and 2 GPUs), the per-op profile of gspn2_tiny and the side-by-side model benchmark.
#   bash scripts/gpu_models.sh [MODELS...]      (logs and JSON land in $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/gspn2_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
MODELS=${*:-gspn2_tiny swin_tiny_patch4_window7_224 convnext_tiny}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$OUT/env.txt"
$PY -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/env.txt"
t0=$(date +%s)
[[ ${SKIP_BUILD:-0} == 1 ]] || CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 \
  $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; echo BUILD FAILED; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
if [[ ${SKIP_DDP:-0} != 1 ]]; then
  for n in 1 2; do
    timeout 240 torchrun --standalone --nproc_per_node=$n scripts/bench_ddp.py --steps ${DDP_STEPS:-200} --warmup 20 \
      --json "$OUT/ddp_${n}gpu.json" >"$OUT/ddp_${n}gpu.log" 2>&1
    echo "ddp n=$n rc=$?"; tail -4 "$OUT/ddp_${n}gpu.log"
  done
fi
if [[ ${SKIP_PROFILE:-0} != 1 ]]; then
  timeout 120 $PY scripts/profile_model.py --model gspn2_tiny --task train --rows 35 >"$OUT/profile_train.txt" 2>&1
  echo "profile train rc=$?"; head -40 "$OUT/profile_train.txt"
  timeout 120 $PY scripts/profile_model.py --model gspn2_tiny --task infer --batch-size 256 --rows 20 >"$OUT/profile_infer.txt" 2>&1
  echo "profile infer rc=$?"; head -25 "$OUT/profile_infer.txt"
fi
timeout ${BENCH_TIMEOUT:-300} $PY scripts/bench_models.py --models $MODELS ${BENCH_ARGS:---modes eager} \
  --json "$OUT/bench_models.json" --md "$OUT/bench_models.md" --plot "$OUT/bench_models.png" >"$OUT/bench_models.log" 2>&1
echo "bench_models rc=$?"; tail -30 "$OUT/bench_models.log"
