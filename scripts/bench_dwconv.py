"""Depthwise convolution: gspn2's CUDA kernel against cuDNN, on the GSPN-2 models' shapes.

    python scripts/bench_dwconv.py                       # gspn2_tiny's shapes, bf16, channels_last
    python scripts/bench_dwconv.py --variants "" t0v4 t1v8 --json runs/bench_dwconv.json

For each (channels, resolution, kernel) of ``--model`` (the two 3x3 local perception units on C channels
and the mixer's 7x7 on its hidden width, per stage at 224^2 input): forward (``x + conv(x)`` for the 3x3,
``conv(x)`` for the 7x7, as the blocks call them) and backward (input, weight and bias gradients), median
of ``--iters``; cuDNN through ``F.conv2d`` / ``aten.convolution_backward`` on the same tensors (the option
``dwconv="cudnn"`` in the same process), and each kernel variant asked for (``--variants``). ``--timing
graph`` (the default) replays 20 calls of each op from a CUDA graph, so small shapes show kernel time, not
Python's; ``--timing events`` times each Python call. Also the largest error of each against a float32
cuDNN run.
Needs a CUDA GPU and the built extension.
"""

from __future__ import annotations

import argparse
import collections
import json

import timm
import torch

import gspn2  # noqa: F401  (registers the models)
from gspn2.benchmark import DWCONV_VARIANTS, dwconv_shapes, dwconv_variant_options, graph_ms, median_ms
from gspn2.ops import depthwise_conv2d, options
from gspn2.ops.dwconv import kernel_available
from gspn2.ops.dwconv import variant as variant_args


def run_case(C: int, side: int, K: int, add: bool, batch: int, dtype: torch.dtype, iters: int, backend: str,
             variant: str = "", timing: str = "graph") -> dict:
    """``variant``: ``t<kernel>v<cols>`` (gspn2.benchmark.DWCONV_VARIANTS: ``dwconv_kernel`` "tile" (kernel 0),
    "fused" (kernel 1) or "mma" (kernel 2, 16-bit only) with ``dwconv_tile_cols`` = cols); "" for the defaults
    (``dwconv_kernel="auto"``)."""
    opts = {"dwconv_tile_cols": options.Options().dwconv_tile_cols, **dwconv_variant_options(variant)}
    options.set_options(**opts, dwconv=backend)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, C, side, side, device="cuda", generator=g).to(dtype, memory_format=torch.channels_last)
    w = torch.randn(C, 1, K, K, device="cuda", generator=g) * 0.1
    b = torch.randn(C, device="cuda", generator=g)
    xg, wg, bg = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    gy = torch.randn_like(x)
    y = depthwise_conv2d(xg, wg, bg, add)
    if timing == "events":
        fwd = median_ms(lambda: depthwise_conv2d(x, w, b, add), 3, iters)
        bwd = median_ms(lambda: torch.autograd.grad(y, (xg, wg, bg), gy, retain_graph=True), 3, iters)
    else:
        # The ops themselves, replayed from a CUDA graph: kernel time only. The backward is the backward op
        # (gspn2's, or aten's convolution_backward plus grad_y for x + conv(x)), as autograd calls it.
        fwd = graph_ms(lambda: depthwise_conv2d(x, w, b, add), reps=20, iters=iters)
        if backend == "cudnn":
            w16 = w.to(dtype)

            def backward():
                gx, gw, gb = torch.ops.aten.convolution_backward(
                    gy, x, w16, [C], [1, 1], [K // 2, K // 2], [1, 1], False, [0, 0], C, [True, True, True])
                return (gx + gy if add else gx), gw, gb
        else:
            kernel, cols = variant_args(K)

            def backward():
                return torch.ops.gspn2.depthwise_conv2d_backward.default(gy, x, w, True, add, kernel, cols)
        bwd = graph_ms(backward, reps=20, iters=iters)
    grads = torch.autograd.grad(y, (xg, wg, bg), gy, retain_graph=True)
    # float32 cuDNN on the same values: the error of this backend's low-precision run
    options.set_options(dwconv="cudnn")
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
    y32 = depthwise_conv2d(x32, w32, b32, add)
    g32 = torch.autograd.grad(y32, (x32, w32, b32), gy.float())
    rel = lambda a, r: ((a.float() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()  # noqa: E731
    err = max(rel(y, y32.detach()), *(rel(a, r) for a, r in zip(grads, g32)))
    return dict(backend=backend, variant=variant or "-", C=C, side=side, K=K, add_input=add, batch=batch, timing=timing,
                fwd_ms=fwd, bwd_ms=bwd, max_rel_err=err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gspn2_tiny")
    ap.add_argument("--resolution", type=int, default=224)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=[""], choices=["", *DWCONV_VARIANTS],
                    help="kernel variants to time: t<kernel>v<cols> (kernel 0: input- and weight-gradient kernels, "
                         "1: one-pass backward; <cols> output columns per thread); '' = the defaults (auto)")
    ap.add_argument("--timing", choices=["graph", "events"], default="graph",
                    help="graph: the ops replayed from a CUDA graph (kernel time; the backward op called directly); "
                         "events: CUDA events around each Python call (forward, and autograd.grad for the backward), "
                         "host cost included where it exceeds the kernels'")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_dwconv.py needs a CUDA GPU")
    if not kernel_available():
        raise SystemExit("bench_dwconv.py needs gspn2's CUDA extension: pip install --no-build-isolation -e .")
    if not timm.is_model(args.model):
        raise SystemExit(f"--model: unknown timm model {args.model!r}")
    torch.backends.cudnn.benchmark = True
    dtype = getattr(torch, args.dtype)
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, channels_last, batch {args.batch}, "
          f"timing {args.timing}")
    variants = [("cuda", v) for v in args.variants]
    head = " ".join(f"{v or 'default':>9s}" for _, v in variants)
    print(f"{'C':>5s} {'side':>5s} {'K':>2s} {'+x':>3s} | fwd ms: {'cuDNN':>7s} {head} | bwd ms: {'cuDNN':>7s} {head} | max err cuDNN / ours")
    tot = {v: [0.0, 0.0] for v in [("cudnn", "")] + variants}
    step = {v: collections.Counter() for v in tot}  # forward + backward times calls, per kernel size
    for C, side, K, add, calls in dwconv_shapes(args.model, args.resolution):
        res = {v: run_case(C, side, K, add, args.batch, dtype, args.iters, *v, timing=args.timing) for v in tot}
        for r in res.values():
            r["calls"] = calls
        rows += list(res.values())
        for v, r in res.items():
            tot[v][0] += r["fwd_ms"]
            tot[v][1] += r["bwd_ms"]
            step[v][K] += calls * (r["fwd_ms"] + r["bwd_ms"])
        c = res[("cudnn", "")]
        fw = " ".join(f"{res[v]['fwd_ms']:9.3f}" for v in variants)
        bw = " ".join(f"{res[v]['bwd_ms']:9.3f}" for v in variants)
        err = max(res[v]["max_rel_err"] for v in variants)
        print(f"{C:5d} {side:5d} {K:2d} {'y' if add else 'n':>3s} | fwd ms: {c['fwd_ms']:7.3f} {fw} | "
              f"bwd ms: {c['bwd_ms']:7.3f} {bw} | {c['max_rel_err']:.1e} / {err:.1e}")
    c = tot[("cudnn", "")]
    for v in variants:
        f, b = tot[v]
        print(f"sum (one block per stage), {v[1] or 'default'}: forward {c[0]:.3f} -> {f:.3f} ms ({c[0] / f:.2f}x), "
              f"backward {c[1]:.3f} -> {b:.3f} ms ({c[1] / b:.2f}x)")
    cs = step[("cudnn", "")]
    for v in variants:
        per_k = ", ".join(f"{k}x{k} {cs[k]:.2f} -> {step[v][k]:.2f}" for k in sorted(cs))
        print(f"per training step (every block, forward + backward), {v[1] or 'default'}: {per_k} ms; all "
              f"{sum(cs.values()):.2f} -> {sum(step[v].values()):.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype=args.dtype,
                           batch=args.batch, timing=args.timing, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
