#!/usr/bin/env bash
# Which cluster test case crashes, and where (host backtrace).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 CUDA_HOME=/usr/local/cuda
ls gspn2/_C.cpython-312*.so >/dev/null 2>&1 || python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
which gdb cuda-gdb
ids=$(python3 -m pytest --collect-only -q -p no:cacheprovider tests/ops/test_cuda.py -k cluster 2>/dev/null | grep "::")
first=""
for id in $ids; do
  timeout 60 python3 -X faulthandler -m pytest -q -p no:cacheprovider "$id" > "$OUT/one.log" 2>&1
  rc=$?
  echo "rc=$rc $id $(grep -E 'passed|failed' "$OUT/one.log" | tail -1)"
  if [ $rc -ne 0 ] && [ -z "$first" ]; then first=$id; cp "$OUT/one.log" "$OUT/first_fail.log"; fi
done
if [ -n "$first" ]; then
  G=$(which gdb || which cuda-gdb)
  timeout 120 $G -batch -ex run -ex bt --args python3 -m pytest -q -p no:cacheprovider "$first" > "$OUT/gdb.log" 2>&1
  grep -E "^#[0-9]+" "$OUT/gdb.log" | head -25
  grep -E "Error|error|assert" "$OUT/first_fail.log" | head -10
fi
