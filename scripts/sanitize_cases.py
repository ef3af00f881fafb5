"""Small forward + backward calls of gspn2's CUDA kernels, sized for ``compute-sanitizer`` (memcheck,
racecheck): every kernel family, dtype and code path runs once on a few hundred to a few thousand pixels.
``scripts/gpu_check.sh sanitize`` runs each group under each tool.

    compute-sanitizer --tool memcheck python scripts/sanitize_cases.py op
    compute-sanitizer --tool racecheck python scripts/sanitize_cases.py short
    compute-sanitizer --tool racecheck python scripts/sanitize_cases.py cluster    # sm_90 only
    compute-sanitizer --tool memcheck python scripts/sanitize_cases.py dwconv

Groups:

* ``op``: the propagation op under the default kernel choice: fp32 / bf16 / fp16, one to 32 channels,
  chunks, the streaming kernels' ring and tile paths, a 300-pixel line.
* ``short``: the short-line kernels forced (``GSPN2_KERNEL=short``): fp32 / bf16 / fp16, groups of 1, 2, 4 and
  8 channels, one and two lines per warp, H != W, chunks, planes whose bytes are not a multiple of 16.
* ``cluster``: the thread-block-cluster kernels forced (``GSPN2_KERNEL=cluster``; Hopper only), forward
  and backward, fp32 / bf16 / fp16, K < C and chunk restarts; the vertical lines split over 2 CTAs, with
  exchanges every 16 steps on the taller images. The backward runs through autograd, i.e. on
  autograd's device thread, where the kernels must bind the CUDA context themselves. Then CTA counts set
  with ``cluster_ctas``: the float32 forward with one stage buffer (304 rows per CTA, forward only: the
  float32 backward takes at most 128 rows), the 16-bit backward with 256 rows per CTA (two TMA boxes
  per plane) and the bf16 forward with 512 rows per CTA (one stage buffer of 64-byte rows, two tiles per
  copy).
* ``dwconv``: the depthwise convolution kernels forced for every kernel size (``GSPN2_DWCONV=cuda``) with
  both backwards and both column counts, with and without the residual, and the inference-only fused SiLU;
  also on shapes whose backward CTAs loop over several tiles.
"""

from __future__ import annotations

import argparse
import os

# (B, C, H, W, K, chunk, dtype name)
OP_CASES = [
    (1, 4, 9, 13, 2, 3, "float32"),
    (1, 2, 6, 7, 1, None, "bfloat16"),
    (1, 32, 5, 8, 1, None, "float16"),
    (1, 1, 3, 40, 1, 4, "float32"),
    (1, 2, 16, 24, 1, 5, "bfloat16"),
    (1, 1, 300, 264, 1, 7, "float32"),
]
SHORT_CASES = [
    (3, 2, 7, 7, 1, None, "bfloat16"),
    (2, 4, 9, 13, 4, 3, "float32"),
    (2, 8, 14, 14, 2, None, "float16"),
    (2, 2, 5, 30, 1, 4, "bfloat16"),
    (1, 2, 28, 28, 1, None, "float32"),
    (1, 1, 32, 20, 1, 6, "bfloat16"),
]
CLUSTER_CASES = [
    (1, 2, 40, 32, 1, None, "float32"),
    (1, 1, 300, 48, 1, 7, "float32"),
    (1, 4, 37, 32, 2, 3, "float32"),
    (1, 2, 40, 32, 2, 5, "bfloat16"),
    (1, 4, 37, 32, 2, 3, "float16"),
    (1, 1, 40, 208, 1, 7, "float32"),
    (1, 2, 36, 144, 1, None, "bfloat16"),
]
# (B, C, H, W, K, chunk, dtype name, cluster_ctas, backward too)
CLUSTER_CTAS_CASES = [
    (1, 1, 600, 32, 1, 9, "float32", 2, False),
    (1, 2, 500, 32, 1, 7, "bfloat16", 2, True),
    (1, 1, 1000, 64, 1, 9, "bfloat16", 2, False),
    (1, 1, 1000, 64, 1, 5, "float16", 2, False),
]
# (B, C, H, W, kernel size, residual, dtype name)
DWCONV_CASES = [
    (1, 16, 9, 13, 7, True, "bfloat16"),
    (2, 5, 6, 3, 3, False, "float32"),
    (1, 24, 11, 17, 5, True, "float16"),
    (1, 8, 1, 9, 7, False, "float32"),
]
# The tile kernels' backward looping over several tiles per CTA (double-buffered), with a short last chunk.
DWCONV_CHUNK_CASES = [
    (33, 1024, 7, 7, 3, True, "bfloat16"),
    (33, 1024, 7, 7, 7, False, "float32"),
]


def run_op(cases) -> None:
    import torch

    from gspn2.ops import gspn_propagate

    for B, C, H, W, K, chunk, dt in cases:
        dtype = getattr(torch, dt)
        x = torch.randn(B, C, H, W, device="cuda", dtype=dtype, requires_grad=True)
        lam = torch.randn(B, 4, C, H, W, device="cuda", dtype=dtype, requires_grad=True)
        gates = torch.randn(B, 4, 3, K, H, W, device="cuda", dtype=dtype, requires_grad=True)
        h = gspn_propagate(x, lam, gates, chunk)
        torch.autograd.grad(h, (x, lam, gates), torch.randn_like(h))
    torch.cuda.synchronize()


def run_cluster_ctas() -> None:
    import torch

    from gspn2.ops import gspn_propagate, options

    for B, C, H, W, K, chunk, dt, ctas, backward in CLUSTER_CTAS_CASES:
        options.set_options(cluster_ctas=ctas)
        dtype = getattr(torch, dt)
        x = torch.randn(B, C, H, W, device="cuda", dtype=dtype, requires_grad=backward)
        lam = torch.randn(B, 4, C, H, W, device="cuda", dtype=dtype, requires_grad=backward)
        gates = torch.randn(B, 4, 3, K, H, W, device="cuda", dtype=dtype, requires_grad=backward)
        h = gspn_propagate(x, lam, gates, chunk)
        if backward:
            torch.autograd.grad(h, (x, lam, gates), torch.randn_like(h))
    options.set_options(cluster_ctas=0)
    torch.cuda.synchronize()


def run_dwconv() -> None:
    import torch

    from gspn2.benchmark import DWCONV_VARIANTS, dwconv_variant_options
    from gspn2.ops import depthwise_conv2d, options

    for name in DWCONV_VARIANTS:  # every family with 4 and 8 output columns per thread
        options.set_options(**dwconv_variant_options(name))
        for B, C, H, W, k, residual, dt in DWCONV_CASES + DWCONV_CHUNK_CASES:
            if name.startswith("t2") and (dt == "float32" or C % 8):  # the tensor-core kernels: 16-bit, C % 8
                continue
            x = torch.randn(B, C, H, W, device="cuda", dtype=getattr(torch, dt))
            x = x.to(memory_format=torch.channels_last).requires_grad_()
            w = torch.randn(C, 1, k, k, device="cuda", requires_grad=True)
            b = torch.randn(C, device="cuda", requires_grad=True)
            y = depthwise_conv2d(x, w, b, residual)
            torch.autograd.grad(y, (x, w, b), torch.randn_like(y))
            with torch.no_grad():
                depthwise_conv2d(x, w, b, silu=True)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("group", choices=["op", "short", "cluster", "dwconv"])
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("sanitize_cases.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    if args.group == "cluster" and torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("sanitize_cases.py cluster needs an sm_90 GPU: the cluster kernels are Hopper-only")
    # The backend and kernel choices are read from the environment once, when gspn2 is imported: set them first.
    if args.group in ("short", "cluster"):
        os.environ["GSPN2_KERNEL"] = args.group
    if args.group == "dwconv":
        os.environ["GSPN2_DWCONV"] = "cuda"
    import gspn2  # noqa: F401  (registers the ops)

    if args.group == "dwconv":
        run_dwconv()
    else:
        run_op({"op": OP_CASES, "short": SHORT_CASES, "cluster": CLUSTER_CASES}[args.group])
        if args.group == "cluster":
            run_cluster_ctas()
    print(f"sanitize cases '{args.group}' ok")


if __name__ == "__main__":
    main()
