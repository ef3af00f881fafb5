#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 CUDA_HOME=/usr/local/cuda
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
timeout 90 python3 wip/bwd_small.py 2>&1 | tee "$OUT/bwd_small.log" | tail -12
timeout 330 python3 -m pytest -q -rfE -p no:cacheprovider tests/ops/test_cuda.py tests/ops/test_build.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?: $(tail -1 "$OUT/pytest.log")"; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -8
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
timeout 100 compute-sanitizer --tool memcheck --print-limit 10 python3 /tmp/san.py > "$OUT/memcheck.log" 2>&1 || true
echo "memcheck: $(grep 'ERROR SUMMARY' "$OUT/memcheck.log")"
