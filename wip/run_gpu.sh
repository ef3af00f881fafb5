#!/usr/bin/env bash
# Next session's first call on this branch: build, the cluster backward's prototype check, the package
# tests (cluster cases first), memcheck on the cluster kernels, the forward/backward choice benchmark.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 CUDA_HOME=/usr/local/cuda
(cd wip && python3 -c 'import check_cluster_bwd as c; c.build()' > "$OUT/jit.log" 2>&1) &
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
wait
timeout 100 python3 wip/check_cluster_bwd.py 2>&1 | tee "$OUT/check_bwd.log" | grep -v "^$" | tail -12
timeout 200 python3 -m pytest -q -x -rfE -p no:cacheprovider tests/ops/test_cuda.py -k cluster > "$OUT/pytest_cluster.log" 2>&1
echo "pytest -k cluster rc=$?: $(tail -1 "$OUT/pytest_cluster.log")"; grep -E "^(FAILED|ERROR)|Error" "$OUT/pytest_cluster.log" | head -8
cat > /tmp/san.py <<'PYEOF'
import os
os.environ["GSPN2_KERNEL"] = "cluster"
import torch, gspn2
from gspn2.ops import gspn_propagate
for (B, C, H, W, K, chunk) in [(1, 2, 40, 32, 1, None), (1, 2, 300, 48, 1, 7)]:
    x = torch.randn(B, C, H, W, device="cuda", requires_grad=True)
    lam = torch.randn(B, 4, C, H, W, device="cuda", requires_grad=True)
    g = torch.randn(B, 4, 3, K, H, W, device="cuda", requires_grad=True)
    gspn_propagate(x, lam, g, chunk).sum().backward()
torch.cuda.synchronize()
print("ok")
PYEOF
timeout 120 compute-sanitizer --tool memcheck --print-limit 10 python3 /tmp/san.py > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?: $(grep 'ERROR SUMMARY' "$OUT/memcheck.log")"
timeout 240 python3 scripts/bench_op.py --cluster-choice --out-dir "$OUT" 2>&1 | tail -24
