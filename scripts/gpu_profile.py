"""Profiling helper (``scripts/gpu_check.sh ncu``): kernel calls for Nsight Compute, and timings of the
kernel families per shape.

    python scripts/gpu_profile.py run big s128                 # a few calls, for ncu
    python scripts/gpu_profile.py run big@4                    # ... kernel="cluster", cluster_ctas=4 (where it fits)
    python scripts/gpu_profile.py variants big m56             # a table of kernel families per shape
    python scripts/gpu_profile.py dwconv                       # the depthwise kernels on gspn2_tiny's shapes
    python scripts/gpu_profile.py dwconv t0v4 t1v8             # ... with these variants (bench_dwconv.py's names)

``dwconv``: one forward and one backward op call per depthwise convolution shape of gspn2_tiny at 224^2
(batch 128, bf16, channels_last), for ``ncu -k regex:dwconv_tile``; each call's variant and launch plan is
printed first.

Ablations (parts of the kernels skipped; results are wrong) are a build flag: build with
``GSPN2_ABLATE=<bits> pip install --no-build-isolation -e .`` (bits in gspn2/csrc/propagate.h,
``PropagateParams::ablate``; ``gspn2.ops._cuda.limits()["ablate"]`` shows the build's), run ``variants``, and
rebuild without it.
"""

import sys

import torch

import gspn2  # noqa: F401
from gspn2.benchmark import dwconv_shapes, dwconv_variant_options
from gspn2.ops import _cuda, options
from gspn2.ops.dwconv import variant as dwconv_variant

SHAPES = {
    "big": (16, 2, 1024, 1024, 2, torch.float32),
    "bigbf": (16, 2, 1024, 1024, 2, torch.bfloat16),
    "sweep1024": (1, 8, 1024, 1024, 1, torch.float32),
    "s128": (1, 8, 128, 128, 8, torch.float32),
    "s32": (32, 49, 32, 32, 49, torch.float32),
    "m56": (128, 2, 56, 56, 1, torch.bfloat16),
    "m28": (128, 2, 28, 28, 1, torch.bfloat16),
    "m14": (128, 2, 14, 14, 1, torch.bfloat16),
    "m7": (128, 2, 7, 7, 1, torch.bfloat16),
}
VARIANTS = ("auto", "fast", "general", "short")


def run_dwconv(variants: list[str]) -> None:
    names = variants or ["auto"]
    try:
        chosen = [dwconv_variant_options(spec) for spec in names]
    except ValueError as e:
        raise SystemExit(f"gpu_profile.py dwconv: {e}")
    for spec, opts in zip(names, chosen):
        options.set_options(dwconv="cuda", **opts)
        for C, side, K, add, _ in dwconv_shapes("gspn2_tiny", 224):
            kernel, cols = dwconv_variant(K)
            plan = _cuda.dwconv_plan(128, C, side, side, K, "bfloat16", cols)
            print(f"{spec} C={C} side={side} K={K} kernel={kernel} cols={cols} plan={plan}", flush=True)
            x = torch.randn(128, C, side, side, device="cuda").to(torch.bfloat16, memory_format=torch.channels_last)
            w = torch.randn(C, 1, K, K, device="cuda") * 0.1
            b = torch.randn(C, device="cuda")
            torch.ops.gspn2.depthwise_conv2d(x, w, b, add, False, kernel, cols)
            torch.ops.gspn2.depthwise_conv2d_backward(torch.randn_like(x), x, w, True, add, kernel, cols)
    torch.cuda.synchronize()


def main():
    mode, names = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if mode not in ("run", "variants", "dwconv"):
        raise SystemExit(f"gpu_profile.py: the first argument must be run, variants or dwconv, got '{mode}'")
    if mode == "dwconv":
        run_dwconv(names)
        return
    runs = []  # every shape checked before the first call
    for spec in names:
        name, _, ctas = spec.partition("@")
        if name not in SHAPES or ctas not in ("", "2", "4", "8"):
            raise SystemExit(f"gpu_profile.py: unknown shape '{spec}' (shapes: {', '.join(SHAPES)}; "
                             "optionally @2, @4 or @8 for the cluster kernels at that many CTAs per line)")
        runs.append((name, int(ctas or 0)))
    for name, n in runs:
        family = "cluster" if n else "auto"
        B, C, H, W, K, dt = SHAPES[name]
        x = torch.randn(B, C, H, W, device="cuda", dtype=dt)
        lam = torch.randn(B, 4, C, H, W, device="cuda", dtype=dt)
        g = torch.randn(B, 4, 3, K, H, W, device="cuda", dtype=dt)
        h = torch.ops.gspn2.propagate(x, lam, g, None, family, n)
        gh = torch.randn_like(h)
        try:
            torch.ops.gspn2.propagate_backward(gh, x, lam, g, h, None, family, n)
        except ValueError as e:  # shape@ctas: the float32 backward takes at most 128 rows per CTA
            if not n:
                raise
            print(f"{name}@{n}: backward not run: {e}", flush=True)
        if mode != "variants":
            continue
        from triton.testing import do_bench

        ablate = _cuda.limits()["ablate"]
        for kernel in VARIANTS:
            try:
                _cuda.plan(B, C, H, W, K, str(dt).split(".")[1], kernel=kernel)
            except ValueError as e:  # a family that does not take this shape (kernel="short" on long lines)
                print(f"{name:10s} kernel={kernel:8s} skipped: {e}", flush=True)
                continue
            f = do_bench(lambda: torch.ops.gspn2.propagate(x, lam, g, None, kernel, 0), return_mode="median")
            b = do_bench(lambda: torch.ops.gspn2.propagate_backward(gh, x, lam, g, h, None, kernel, 0), return_mode="median")
            print(f"{name:10s} kernel={kernel:8s} ablate={ablate:<3d} fwd {f:8.4f} ms  bwd {b:8.4f} ms", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
