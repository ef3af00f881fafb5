"""Profiling helper for scripts/gpu_session.sh: kernel calls for Nsight Compute, and stage ablations
(GSPN2_ABLATE=1 skips tile loads, 2 the scan steps, 4 the stores; the results are then wrong).

    python scripts/gpu_profile.py run big s128       # a few calls, for ncu
    GSPN2_ABLATE=2 python scripts/gpu_profile.py time big s128
"""

import os
import sys

import torch

import gspn2  # noqa: F401
from gspn2.ops import _cuda

SHAPES = {
    "big": (16, 2, 1024, 1024, 2, torch.float32),
    "bigbf": (16, 2, 1024, 1024, 2, torch.bfloat16),
    "s128": (1, 8, 128, 128, 8, torch.float32),
    "s32": (32, 49, 32, 32, 49, torch.float32),
    "m56": (128, 8, 56, 56, 1, torch.bfloat16),
}


def main():
    mode, names = sys.argv[1], sys.argv[2:]
    for name in names:
        B, C, H, W, K, dt = SHAPES[name]
        x = torch.randn(B, C, H, W, device="cuda", dtype=dt)
        lam = torch.randn(B, 4, C, H, W, device="cuda", dtype=dt)
        g = torch.randn(B, 4, 3, K, H, W, device="cuda", dtype=dt)
        h = _cuda.forward(x, lam, g, None)
        gh = torch.randn_like(h)
        _cuda.backward(gh, x, lam, g, h, None)
        if mode == "time":
            from triton.testing import do_bench

            f = do_bench(lambda: _cuda.forward(x, lam, g, None), return_mode="median")
            b = do_bench(lambda: _cuda.backward(gh, x, lam, g, h, None), return_mode="median")
            print(f"ablate={os.environ.get('GSPN2_ABLATE', '0')} {name}: fwd {f:.4f} ms  bwd {b:.4f} ms", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
