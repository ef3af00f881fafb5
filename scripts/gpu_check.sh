#!/usr/bin/env bash
# Check gspn2 on an NVIDIA GPU: build the CUDA extension, run the CUDA tests, run compute-sanitizer on small
# cases, then the benchmarks. Run it from anywhere after the README's set-up (`bash scripts/setup_env.sh`):
#
#   bash scripts/gpu_check.sh                       # the default stages: build test sanitize bench-op bench-dwconv bench-models
#   bash scripts/gpu_check.sh test sanitize         # only these stages, in the order given
#   bash scripts/gpu_check.sh all                   # every stage, the profiles, DDP and Nsight Compute included
#   bash scripts/gpu_check.sh --help                # the stages and settings
#
# Stages:
#   build         compile gspn2._C in place for this GPU's architecture (incremental) and import it
#   test          pytest on the CUDA tests (tests/ops/test_cuda.py, test_build.py, test_dwconv.py, test_merge.py,
#                 test_gelu_linear.py, test_norm_backward.py, test_direct_calls.py, test_op.py,
#                 tests/layers/test_pointwise.py,
#                 tests/models/test_gspn2_cuda.py, tests/train/test_gpu_data_cuda.py, test_compile_modes_cuda.py)
#   sanitize      compute-sanitizer memcheck and racecheck on scripts/sanitize_cases.py (op, short, cluster on
#                 sm_90, dwconv); skipped when compute-sanitizer is not installed
#   bench-op      scripts/bench_op.py: the propagation kernels against their bandwidth floor, the general kernels,
#                 the reference and SDPA (QUICK=1: the headline shapes only)
#   bench-cluster scripts/bench_op.py --cluster-choice: streaming against cluster kernels at 2/4/8 CTAs per line
#                 (sm_90 only; long)
#   bench-dwconv  scripts/bench_dwconv.py: the depthwise kernel against cuDNN on gspn2_tiny's shapes
#   bench-merge   scripts/bench_merge.py --sweep: the mixer's output chain as one op against separate ops
#   bench-gelu-linear  scripts/bench_gelu_linear.py --sweep: the MLP's fc2(gelu(h)) as one op against separate ops
#   bench-norm-backward  scripts/bench_norm_backward.py --sweep: the mixer's gated-norm backward as one op against
#                 the compiled separate ops
#   bench-models  scripts/bench_models.py: $MODELS side by side (BENCH_ARGS, default "--modes eager")
#   profile       scripts/profile_model.py: per-operator CUDA time of gspn2_tiny's training step and inference
#   ddp           scripts/bench_ddp.py under torchrun on 1 GPU and on every GPU (needs 2 or more)
#   ncu           scripts/gpu_profile.py: kernel variants, and Nsight Compute on the B16xC2x1024^2 op call and
#                 on the depthwise kernels of gspn2_tiny's shapes; skipped when ncu is not installed
#
# Every stage writes its log (and its JSON / Markdown results) to $OUT; a summary table (stage, status,
# seconds, log) ends the output and is also written to $OUT/summary.md. The exit status is 0 when every
# stage that ran passed, 1 otherwise, 2 for a bad argument or a machine without a usable GPU.
#
# Settings (environment):
#   OUT            log folder (default: runs/gpu_check/<UTC time> in the repository)
#   PYTHON         interpreter (default: .venv/bin/python when it exists, else python3)
#   TORCH_CUDA_ARCH_LIST  build target (default: the compute capability of GPU 0, e.g. 9.0)
#   MAX_JOBS       parallel compile jobs (default: the number of CPU cores)
#   MODELS         models for bench-models (default: gspn2_tiny swin_tiny_patch4_window7_224 convnext_tiny)
#   BENCH_ARGS     extra arguments of bench_models.py (default: --modes eager)
#   QUICK=1        shorter runs: bench_op.py --quick, fewer DDP steps
#   SANITIZE_GROUPS  groups of scripts/sanitize_cases.py for the sanitize stage (default: op short cluster dwconv;
#                  cluster only on sm_90)
#   TIMEOUT        limit per stage in seconds (default 900; 0: none)
set -uo pipefail
cd "$(dirname "$0")/.."

ALL_STAGES=(build test sanitize bench-op bench-cluster bench-dwconv bench-merge bench-gelu-linear bench-norm-backward bench-models profile ddp ncu)
DEFAULT_STAGES=(build test sanitize bench-op bench-dwconv bench-models)

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

# Arguments first: nothing is written before they are all known to be valid.
STAGES=()
for arg in "$@"; do
  case $arg in
    -h|--help) usage; exit 0 ;;
    all) STAGES+=("${ALL_STAGES[@]}") ;;
    *)
      known=0
      for s in "${ALL_STAGES[@]}"; do [[ $arg == "$s" ]] && known=1; done
      if [[ $known == 0 ]]; then
        echo "gpu_check.sh: unknown stage '$arg'; stages: ${ALL_STAGES[*]} (or all; --help)" >&2
        exit 2
      fi
      STAGES+=("$arg") ;;
  esac
done
[[ ${#STAGES[@]} -gt 0 ]] || STAGES=("${DEFAULT_STAGES[@]}")
if [[ -n ${TIMEOUT:-} && ! ${TIMEOUT} =~ ^[0-9]+$ ]]; then
  echo "gpu_check.sh: TIMEOUT must be a whole number of seconds, got '$TIMEOUT'" >&2
  exit 2
fi
for group in ${SANITIZE_GROUPS:-}; do
  if [[ $group != op && $group != short && $group != cluster && $group != dwconv ]]; then
    echo "gpu_check.sh: SANITIZE_GROUPS takes op, short, cluster and dwconv, got '$group'" >&2
    exit 2
  fi
done
if [[ -n ${QUICK:-} && ${QUICK} != 0 && ${QUICK} != 1 ]]; then
  echo "gpu_check.sh: QUICK must be 0 or 1, got '$QUICK'" >&2
  exit 2
fi

if [[ -n ${PYTHON:-} ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu_check.sh: Python interpreter '$PY' not found; run 'bash scripts/setup_env.sh' first or set PYTHON" >&2
  exit 2
fi
if ! gpu=$("$PY" -c "
import torch
if not torch.cuda.is_available():
    raise SystemExit('torch.cuda.is_available() is False (torch ' + torch.__version__ + ', CUDA ' + str(torch.version.cuda) + ')')
p = torch.cuda.get_device_properties(0)
print(f'{p.major}.{p.minor} {torch.cuda.device_count()} {p.name}')
" 2>&1); then
  echo "gpu_check.sh needs an NVIDIA GPU that torch can use: ${gpu##*$'\n'}" >&2
  exit 2
fi
read -r CAP NGPU GPU_NAME <<<"${gpu##*$'\n'}"   # the last line: warnings may come first

OUT=${OUT:-runs/gpu_check/$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LIMIT=${TIMEOUT:-900}
QUICK=${QUICK:-0}
MODELS=${MODELS:-gspn2_tiny swin_tiny_patch4_window7_224 convnext_tiny}

# The environment every figure depends on: GPU, driver, clocks, torch / CUDA / timm / triton, nvcc.
{
  echo "gpu_check.sh at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)'), $(date -u '+%Y-%m-%d %H:%M UTC')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  "$PY" -c "
import platform, torch
mods = []
for name in ('timm', 'triton'):
    try:
        mods.append(f'{name} {__import__(name).__version__}')
    except ImportError:
        mods.append(f'{name} not installed')
print(f'Python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, ' + ', '.join(mods))
print(f'GPU 0: {torch.cuda.get_device_name(0)} (sm_{torch.cuda.get_device_capability(0)[0]}{torch.cuda.get_device_capability(0)[1]}), {torch.cuda.device_count()} GPU(s)')"
  command -v nvcc >/dev/null && nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.txt"

SUMMARY=()
FAILED=0
BUILD_OK=1

# run_stage NAME LOG COMMAND...: runs COMMAND with the stage's time limit, output to $OUT/LOG.
run_stage() {
  local name=$1 log=$2; shift 2
  local t0 rc
  t0=$(date +%s)
  echo "== $name: $* (log: $OUT/$log)"
  if [[ $LIMIT == 0 ]]; then "$@" >"$OUT/$log" 2>&1; else timeout "$LIMIT" "$@" >"$OUT/$log" 2>&1; fi
  rc=$?
  local status=ok
  if [[ $rc == 124 ]]; then status="FAILED (timed out after $LIMIT s)"; FAILED=1
  elif [[ $rc != 0 ]]; then status="FAILED (rc=$rc)"; FAILED=1
  fi
  SUMMARY+=("| $name | $status | $(( $(date +%s) - t0 )) | $log |")
  echo "   $status; last lines:"
  tail -n 5 "$OUT/$log" | sed 's/^/   /'
  [[ $rc == 0 ]] || grep -E "^(FAILED|ERROR)" "$OUT/$log" | head -n 20 | sed 's/^/   /'
  return $rc
}
skip_stage() { SUMMARY+=("| $1 | skipped: $2 | 0 | |"); echo "== $1: skipped ($2)"; }

stage_build() {
  local arch=${TORCH_CUDA_ARCH_LIST:-$CAP}
  run_stage build build.log env TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
    "$PY" setup.py build_ext --inplace || { BUILD_OK=0; return; }
  run_stage "build: import gspn2._C" build_import.log "$PY" -c "import gspn2._C as C; print('gspn2._C loaded from', C.__file__)" \
    || BUILD_OK=0
}

stage_test() {
  run_stage test pytest_cuda.log "$PY" -m pytest -q -rfE -p no:cacheprovider -W ignore::DeprecationWarning \
    tests/ops/test_cuda.py tests/ops/test_build.py tests/ops/test_dwconv.py tests/ops/test_merge.py \
    tests/ops/test_gelu_linear.py tests/ops/test_norm_backward.py tests/ops/test_direct_calls.py tests/ops/test_op.py \
    tests/layers/test_pointwise.py \
    tests/models/test_gspn2_cuda.py \
    tests/train/test_gpu_data_cuda.py tests/train/test_compile_modes_cuda.py
}

stage_sanitize() {
  if ! command -v compute-sanitizer >/dev/null; then skip_stage sanitize "compute-sanitizer not found"; return; fi
  local groups=()
  for group in ${SANITIZE_GROUPS:-op short cluster dwconv}; do
    if [[ $group == cluster && ${CAP%%.*} -lt 9 ]]; then
      skip_stage "sanitize cluster" "needs sm_90, GPU is sm_${CAP/./}"
    else
      groups+=("$group")
    fi
  done
  for group in "${groups[@]}"; do
    for tool in memcheck racecheck; do
      run_stage "sanitize $group $tool" "sanitizer_${group}_$tool.log" compute-sanitizer --tool "$tool" \
        --error-exitcode 9 --print-limit 20 "$PY" scripts/sanitize_cases.py "$group"
    done
  done
}

stage_bench_op() {
  local quick=(); [[ $QUICK == 1 ]] && quick=(--quick)
  run_stage bench-op bench_op.log "$PY" scripts/bench_op.py --out-dir "$OUT/bench_op" "${quick[@]}"
}

stage_bench_cluster() {
  if [[ ${CAP%%.*} -lt 9 ]]; then skip_stage bench-cluster "needs sm_90, GPU is sm_${CAP/./}"; return; fi
  run_stage bench-cluster bench_cluster.log "$PY" scripts/bench_op.py --cluster-choice --out-dir "$OUT/bench_cluster"
}

stage_bench_dwconv() {
  run_stage bench-dwconv bench_dwconv.log "$PY" scripts/bench_dwconv.py --batch 128 --variants "" t0v4 t0v8 t1v4 t1v8 \
    --json "$OUT/bench_dwconv.json"
}

stage_bench_merge() {
  run_stage bench-merge bench_merge.log "$PY" scripts/bench_merge.py --sweep --json "$OUT/bench_merge.json"
}

stage_bench_gelu_linear() {
  run_stage bench-gelu-linear bench_gelu_linear.log "$PY" scripts/bench_gelu_linear.py --sweep --json "$OUT/bench_gelu_linear.json"
}

stage_bench_norm_backward() {
  run_stage bench-norm-backward bench_norm_backward.log "$PY" scripts/bench_norm_backward.py --sweep \
    --json "$OUT/bench_norm_backward.json"
}

stage_bench_models() {
  # shellcheck disable=SC2086  # MODELS and BENCH_ARGS are word lists
  run_stage bench-models bench_models.log "$PY" scripts/bench_models.py --models $MODELS ${BENCH_ARGS:---modes eager} \
    --json "$OUT/bench_models.json" --md "$OUT/bench_models.md" --plot "$OUT/bench_models.png"
}

stage_profile() {
  run_stage "profile train" profile_train.txt "$PY" scripts/profile_model.py --model gspn2_tiny --task train --rows 35
  run_stage "profile infer" profile_infer.txt "$PY" scripts/profile_model.py --model gspn2_tiny --task infer \
    --batch-size 256 --rows 20
}

stage_ddp() {
  if [[ $NGPU -lt 2 ]]; then skip_stage ddp "needs 2 or more GPUs, found $NGPU"; return; fi
  local steps=200; [[ $QUICK == 1 ]] && steps=30
  local torchrun=("$PY" -m torch.distributed.run --standalone)
  for n in 1 "$NGPU"; do
    # NVLink multicast (NVLS) off: not every multi-GPU host supports it, and DDP's all-reduce does not need it.
    run_stage "ddp ${n} GPU" "ddp_${n}gpu.log" env NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 "${torchrun[@]}" --nproc_per_node="$n" \
      scripts/bench_ddp.py --steps "$steps" --warmup 20 --json "$OUT/ddp_${n}gpu.json"
  done
}

stage_ncu() {
  run_stage "ncu variants" variants.txt "$PY" scripts/gpu_profile.py variants big bigbf sweep1024 m56 m28 s32
  if ! command -v ncu >/dev/null; then skip_stage "ncu kernels" "ncu (Nsight Compute) not found"; return; fi
  run_stage "ncu kernels" ncu_big.txt ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    -k "regex:cluster|fast|split|reduce" -c 6 "$PY" scripts/gpu_profile.py run big
  run_stage "ncu dwconv" ncu_dwconv.txt ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --metrics smsp__inst_executed.sum,smsp__sass_thread_inst_executed_op_ffma_pred_on.sum \
    -k "regex:dwconv_tile" "$PY" scripts/gpu_profile.py dwconv
}

for stage in "${STAGES[@]}"; do
  if [[ $BUILD_OK == 0 && $stage != build ]]; then skip_stage "$stage" "the build failed"; continue; fi
  case $stage in
    build) stage_build ;;
    test) stage_test ;;
    sanitize) stage_sanitize ;;
    bench-op) stage_bench_op ;;
    bench-cluster) stage_bench_cluster ;;
    bench-dwconv) stage_bench_dwconv ;;
    bench-merge) stage_bench_merge ;;
    bench-gelu-linear) stage_bench_gelu_linear ;;
    bench-norm-backward) stage_bench_norm_backward ;;
    bench-models) stage_bench_models ;;
    profile) stage_profile ;;
    ddp) stage_ddp ;;
    ncu) stage_ncu ;;
  esac
done

{
  echo
  echo "gpu_check.sh on $GPU_NAME (sm_${CAP/./}, $NGPU GPU(s)); logs in $OUT"
  echo
  echo "| stage | status | s | log |"
  echo "|---|---|---|---|"
  printf '%s\n' "${SUMMARY[@]}"
} | tee "$OUT/summary.md"
exit $FAILED
