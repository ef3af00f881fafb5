"""PROTOTYPE check (branch wip/cluster-backward): JIT-build wip/cluster_bwd.cu, compare its horizontal
directions with the shipped backward, time it against the streaming backward's horizontal blocks.

    PYTHONPATH=. python3 wip/check_cluster_bwd.py      # on the GPU machine, after building gspn2._C
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.utils.cpp_extension import load

from gspn2.benchmark import median_ms
from gspn2.ops import _cuda, gspn_propagate

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(os.path.dirname(HERE), "gspn2", "csrc")


def build():
    t0 = time.time()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    mod = load(name="wip_cluster_bwd", sources=[os.path.join(HERE, "cluster_bwd.cu")], extra_include_paths=[CSRC],
               extra_cuda_cflags=["-O3", "-lineinfo", "-std=c++20"], verbose=False)
    print(f"build {time.time() - t0:.0f} s", flush=True)
    return mod


def inputs(B, C, H, W, chunk, seed=0):
    """K = C; lam of the vertical directions zero, so the shipped grad_x is the horizontal terms' sum."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, C, H, W, device="cuda", generator=g)
    lam = torch.randn(B, 4, C, H, W, device="cuda", generator=g)
    lam[:, 2:] = 0
    gates = 2 * torch.randn(B, 4, 3, C, H, W, device="cuda", generator=g)
    h = gspn_propagate(x, lam, gates, chunk)
    grad_h = torch.randn(B, 4, C, H, W, device="cuda", generator=g)
    return grad_h, x, lam, gates, h


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> int:
    mod = build()
    ok = True
    for (B, C, H, W, chunk, ncta) in [(2, 2, 64, 64, None, 2), (1, 3, 100, 48, 7, 4), (1, 2, 37, 32, None, 2),
                                      (2, 2, 1024, 64, None, 8), (1, 2, 1024, 1024, 300, 8), (3, 1, 130, 16, 1, 4),
                                      (1, 1, 20, 32, 5, 2)]:
        gh, x, lam, gates, h = inputs(B, C, H, W, chunk)
        ref = _cuda.backward(gh, x, lam, gates, h, chunk)
        glam, gx, gg = mod.cluster_backward(gh, x, lam, gates, h, chunk or 0, ncta)
        torch.cuda.synchronize()
        errs = (rel(gx[0] + gx[1], ref[0]), rel(glam[:, :2], ref[1][:, :2]), rel(gg[:, :2], ref[2][:, :2]))
        bad = max(errs) > 1e-5 or not all(torch.isfinite(t).all() for t in (glam, gx, gg))
        ok &= not bad
        print(f"B{B} C{C} {H}x{W} chunk={chunk} ncta={ncta}: rel err grad_x {errs[0]:.1e} grad_lam {errs[1]:.1e} "
              f"grad_gates {errs[2]:.1e} {'MISMATCH' if bad else 'ok'}", flush=True)
        if bad:
            for name, got, want in (("grad_lam", glam[:, :2], ref[1][:, :2]), ("grad_gates", gg[:, :2], ref[2][:, :2])):
                e = (got - want).abs() > 1e-4 * want.abs().max()
                dims = tuple(range(e.dim()))
                rows = e.any(dim=tuple(d for d in dims if d != e.dim() - 2)).nonzero().flatten().tolist()
                cols = e.any(dim=tuple(d for d in dims if d != e.dim() - 1)).nonzero().flatten().tolist()
                print(f"   {name}: {len(rows)} bad rows {rows[:12]} {len(cols)} bad cols {cols[:12]}")
    if not ok:
        return 1
    gh, x, lam, gates, h = inputs(16, 2, 1024, 1024, None)
    rows = []
    for ncta in (8,):
        rows.append((f"cluster backward, {ncta} CTAs/line", median_ms(
            lambda: mod.cluster_backward(gh, x, lam, gates, h, 0, ncta), 3, 10)))
    os.environ["GSPN2_ABLATE"] = "16"
    rows.append(("streaming backward, horizontal blocks + reduce", median_ms(
        lambda: _cuda.backward(gh, x, lam, gates, h, None), 3, 10)))
    del os.environ["GSPN2_ABLATE"]
    rows.append(("streaming backward, all four directions", median_ms(
        lambda: _cuda.backward(gh, x, lam, gates, h, None), 3, 10)))
    for name, ms in rows:
        print(f"{name:50s} {ms:7.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
