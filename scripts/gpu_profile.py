"""Profiling helper (``scripts/gpu_check.sh ncu``): kernel calls for Nsight Compute, and timings of the
kernel families per shape.

    python scripts/gpu_profile.py run big s128                 # a few calls, for ncu
    python scripts/gpu_profile.py variants big m56             # a table of kernel families per shape

Ablations (parts of the kernels skipped; results are wrong) are a build flag: build with
``GSPN2_ABLATE=<bits> pip install --no-build-isolation -e .`` (bits in gspn2/csrc/propagate.h,
``PropagateParams::ablate``; ``gspn2.ops._cuda.limits()["ablate"]`` shows the build's), run ``variants``, and
rebuild without it.
"""

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
VARIANTS = ("auto", "fast", "general")


def main():
    mode, names = sys.argv[1], sys.argv[2:]
    for name in names:
        B, C, H, W, K, dt = SHAPES[name]
        x = torch.randn(B, C, H, W, device="cuda", dtype=dt)
        lam = torch.randn(B, 4, C, H, W, device="cuda", dtype=dt)
        g = torch.randn(B, 4, 3, K, H, W, device="cuda", dtype=dt)
        h = torch.ops.gspn2.propagate(x, lam, g, None, "auto", 0)
        gh = torch.randn_like(h)
        torch.ops.gspn2.propagate_backward(gh, x, lam, g, h, None, "auto", 0)
        if mode != "variants":
            continue
        from triton.testing import do_bench

        ablate = _cuda.limits()["ablate"]
        for kernel in VARIANTS:
            f = do_bench(lambda: torch.ops.gspn2.propagate(x, lam, g, None, kernel, 0), return_mode="median")
            b = do_bench(lambda: torch.ops.gspn2.propagate_backward(gh, x, lam, g, h, None, kernel, 0), return_mode="median")
            print(f"{name:10s} kernel={kernel:8s} ablate={ablate:<3d} fwd {f:8.4f} ms  bwd {b:8.4f} ms", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
