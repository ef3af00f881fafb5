#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 CUDA_HOME=/usr/local/cuda
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 1; }
cat > /tmp/d.py <<'PY'
import os, torch
os.environ["GSPN2_KERNEL"] = "cluster"; os.environ["GSPN2_DEBUG_TMAP"] = "1"
from gspn2.ops import _cuda
from gspn2 import _C
for (B, C, H, W, K, chunk) in [(33, 1, 40, 16, 1, 5), (1, 8, 256, 256, 1, None)]:
    x = torch.randn(B, C, H, W, device="cuda"); lam = torch.randn(B, 4, C, H, W, device="cuda")
    g = torch.randn(B, 4, 3, K, H, W, device="cuda")
    print("plan", _cuda.plan(B, C, H, W, K, "float32", backward=True), flush=True)
    h, err = _C.forward(x, lam, g, chunk); print("fwd err", repr(err), flush=True)
    out, err = _C.backward(torch.randn_like(h), x, lam, g, h, chunk); print("bwd err", repr(err), flush=True)
    torch.cuda.synchronize()
PY
timeout 60 python3 /tmp/d.py 2>&1 | tail -40
