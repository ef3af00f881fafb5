"""Backward (and forward) times, streaming vs cluster, on shapes below the forward's threshold (fp32)."""
import os

import torch

from gspn2.ops import _cuda


def timeit(fn, reps=30):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


SHAPES = [(32, 49, 32, 32, 49), (128, 2, 32, 32, 1), (128, 8, 64, 64, 1), (1, 8, 64, 64, 1), (1, 8, 128, 128, 8),
          (16, 2, 128, 128, 2), (64, 2, 128, 128, 2), (1, 8, 192, 192, 1), (16, 2, 256, 256, 2), (1, 8, 256, 256, 1)]
print(f"{'shape':>22} {'fwd fast':>9} {'fwd clu':>9} {'bwd fast':>9} {'bwd clu':>9} ncta_b")
for B, C, H, W, K in SHAPES:
    x = torch.randn(B, C, H, W, device="cuda"); lam = torch.randn(B, 4, C, H, W, device="cuda")
    g = torch.randn(B, 4, 3, K, H, W, device="cuda")
    row = []
    for kind in ("fast", "cluster"):
        os.environ["GSPN2_KERNEL"] = kind
        h = _cuda.forward(x, lam, g)
        gh = torch.randn_like(h)
        row.append((timeit(lambda: _cuda.forward(x, lam, g)), timeit(lambda: _cuda.backward(gh, x, lam, g, h))))
    ncta = _cuda.plan(B, C, H, W, K, "float32", backward=True)["cluster_ctas"]
    os.environ["GSPN2_KERNEL"] = "auto"
    print(f"{B}x{C}x{H}x{W},K={K}".rjust(22), f"{row[0][0]:9.4f} {row[1][0]:9.4f} {row[0][1]:9.4f} {row[1][1]:9.4f} {ncta}")
