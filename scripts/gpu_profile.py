"""Profiling helper for ``scripts/gpu_check.sh ncu``: kernel calls for Nsight Compute, and
timings of variants switched by environment variables between calls (profiling only):

* ``GSPN2_ABLATE`` (results are wrong): general kernels: 1 skips tile loads, 2 the scan steps, 4 the
  stores; streaming kernels: 8 skips the horizontal blocks, 16 the vertical ones, 64 runs horizontal
  scans through the ring instead of the tile stage.
* ``GSPN2_KERNEL=general`` the general kernels.

    python scripts/gpu_profile.py run big s128                 # a few calls, for ncu
    python scripts/gpu_profile.py variants big m56             # a table of variants per shape
"""

import os
import sys

import torch

import gspn2  # noqa: F401
from gspn2.ops import _cuda

SHAPES = {
    "big": (16, 2, 1024, 1024, 2, torch.float32),
    "bigbf": (16, 2, 1024, 1024, 2, torch.bfloat16),
    "sweep1024": (1, 8, 1024, 1024, 1, torch.float32),
    "s128": (1, 8, 128, 128, 8, torch.float32),
    "s32": (32, 49, 32, 32, 49, torch.float32),
    "m56": (128, 2, 56, 56, 1, torch.bfloat16),
    "m28": (128, 2, 28, 28, 1, torch.bfloat16),
}
VARIANTS = {
    "base": {},
    "horizontal only": {"GSPN2_ABLATE": "16"},
    "vertical only": {"GSPN2_ABLATE": "8"},
    "horizontal ring": {"GSPN2_ABLATE": "64"},
    "horizontal ring only": {"GSPN2_ABLATE": "80"},
    "general kernels": {"GSPN2_KERNEL": "general"},
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
        if mode != "variants":
            continue
        from triton.testing import do_bench

        for label, env in VARIANTS.items():
            os.environ.update(env)
            try:
                f = do_bench(lambda: _cuda.forward(x, lam, g, None), return_mode="median")
                b = do_bench(lambda: _cuda.backward(gh, x, lam, g, h, None), return_mode="median")
            finally:
                for k in env:
                    del os.environ[k]
            print(f"{name:10s} {label:22s} fwd {f:8.4f} ms  bwd {b:8.4f} ms", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
