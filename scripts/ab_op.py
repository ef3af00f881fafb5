"""Compare two builds of the propagation kernels: kernel times and bitwise equality of every output.

A kernel change that keeps the arithmetic (a different schedule, the same operations in the same order) must
give the same bits. Build each version of the extension in its own tree, run ``run`` in each (fixed inputs,
seeded per shape), then ``compare`` the two files (no GPU needed):

    (cd /tmp/base && PYTHONPATH=. python /path/to/scripts/ab_op.py run base.pt)
    PYTHONPATH=. python scripts/ab_op.py run new.pt
    python scripts/ab_op.py compare /tmp/base/base.pt new.pt

``run`` times the forward and the backward op of each shape (median of CUDA-graph replays, triton's
``do_bench_cudagraph``) and keeps h, the three gradients, and the same four with ``chunk=5`` (restarts): whole
tensors for shapes of up to 2^22 elements, sums in float32 beyond. ``--launch`` also records the time of a
one-element copy kernel replayed the same way (a launch and one memory round trip).
"""

from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# (B, C, H, W, K, dtype, kernel): the model shapes (C_proxy 2 and 8), the GSPN-1 anchors, horizontal scans
# through the ring (W = 50), fp16, the 1024^2, 768^2 and 512^2 shapes with the cluster kernels (vertical lines split
# over 2 to 8 CTAs, or at B32 one block per line), the streaming kernels alone.
SHAPES = [
    (128, 2, 56, 56, 1, "bf16", "auto"),
    (128, 2, 28, 28, 1, "bf16", "auto"),
    (128, 2, 14, 14, 1, "bf16", "auto"),
    (128, 2, 7, 7, 1, "bf16", "auto"),
    (128, 2, 56, 56, 1, "fp32", "auto"),
    (128, 2, 14, 14, 1, "fp32", "auto"),
    (128, 8, 56, 56, 1, "bf16", "auto"),
    (128, 8, 28, 28, 1, "bf16", "auto"),
    (32, 49, 32, 32, 49, "fp32", "auto"),
    (1, 8, 128, 128, 8, "fp32", "auto"),
    (1, 8, 256, 256, 1, "fp32", "auto"),
    (1, 8, 256, 256, 1, "bf16", "auto"),
    (128, 2, 56, 50, 1, "bf16", "auto"),
    (4, 2, 64, 64, 2, "fp16", "auto"),
    (16, 2, 1024, 1024, 2, "fp32", "auto"),
    (16, 2, 1024, 1024, 2, "bf16", "auto"),
    (4, 2, 1024, 1024, 2, "fp32", "auto"),
    (1, 8, 1024, 1024, 1, "fp32", "auto"),
    (8, 2, 1024, 1024, 2, "fp32", "auto"),
    (16, 2, 768, 768, 2, "fp32", "auto"),
    (32, 2, 1024, 1024, 2, "fp32", "auto"),
    (16, 2, 512, 512, 2, "fp32", "auto"),
    (16, 2, 512, 512, 2, "bf16", "auto"),
    (2, 2, 512, 512, 1, "bf16", "fast"),
]
WHOLE_MAX = 1 << 22  # elements of x up to which whole tensors are kept


def key(shape) -> str:
    B, C, H, W, K, dtype, kernel = shape
    return f"{B}x{C}x{H}x{W} K={K} {dtype} {kernel}"


def inputs(shape):
    B, C, H, W, K, dtype, _ = shape
    g = torch.Generator(device="cuda").manual_seed(7 * B + 13 * C + 17 * H + W + K)
    d = DTYPES[dtype]
    x = torch.randn(B, C, H, W, device="cuda", generator=g).to(d)
    lam = torch.rand(B, 4, C, H, W, device="cuda", generator=g).to(d)
    gates = (2 * torch.randn(B, 4, 3, K, H, W, device="cuda", generator=g)).to(d)
    grad_h = torch.randn(B, 4, C, H, W, device="cuda", generator=g).to(d)
    return x, lam, gates, grad_h


def run(path: str, launch: bool, match: str | None = None) -> None:
    import gspn2  # noqa: F401  (registers the ops)
    from gspn2.ops import _cuda  # noqa: F401  (the CUDA implementations)
    from triton.testing import do_bench_cudagraph

    def ms(fn) -> float:
        return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))

    result = {"rows": {}, "outputs": {}, "launch_us": None}
    if launch:
        a, b = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
        result["launch_us"] = 1e3 * ms(lambda: b.copy_(a))
    for shape in SHAPES:
        if match is not None and not any(m in key(shape) for m in match.split(",")):
            continue
        kernel = shape[-1]
        x, lam, gates, grad_h = inputs(shape)
        fwd = lambda chunk=None: torch.ops.gspn2.propagate(x, lam, gates, chunk, kernel, 0)  # noqa: E731
        h = fwd()
        bwd = lambda h=h, chunk=None: torch.ops.gspn2.propagate_backward(  # noqa: E731
            grad_h, x, lam, gates, h, chunk, kernel, 0
        )
        hc = fwd(5)
        outs = [h, *bwd(), hc, *bwd(hc, 5)]
        whole = x.numel() <= WHOLE_MAX
        result["outputs"][key(shape)] = [t.cpu() if whole else t.float().sum().reshape(1).cpu() for t in outs]
        t_fwd, t_bwd = 1e3 * ms(fwd), 1e3 * ms(bwd)
        result["rows"][key(shape)] = (t_fwd, t_bwd)
        print(f"{key(shape):32s} fwd {t_fwd:9.2f} us  bwd {t_bwd:9.2f} us", flush=True)
    result["device"] = torch.cuda.get_device_name()
    torch.save(result, path)


def compare(path_a: str, path_b: str) -> str:
    """A markdown table: forward and backward microseconds of both builds, their ratio, bitwise equality."""
    a, b = torch.load(path_a), torch.load(path_b)
    lines = []
    if a.get("launch_us") is not None and b.get("launch_us") is not None:
        lines.append(f"one-element copy kernel (launch + one round trip): {a['launch_us']:.2f} / {b['launch_us']:.2f} us\n")
    lines.append("| shape | fwd A (us) | fwd B | B / A | bwd A (us) | bwd B | B / A | outputs bitwise equal |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for k, (fa, ba) in a["rows"].items():
        if k not in b["rows"]:
            lines.append(f"| {k} | {fa:.2f} | - | - | {ba:.2f} | - | - | not in B |")
            continue
        fb, bb = b["rows"][k]
        same = len(a["outputs"][k]) == len(b["outputs"][k]) and all(
            torch.equal(x, y) for x, y in zip(a["outputs"][k], b["outputs"][k])
        )
        lines.append(f"| {k} | {fa:.2f} | {fb:.2f} | {fb / fa:.2f} | {ba:.2f} | {bb:.2f} | {bb / ba:.2f} | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time and keep the outputs of this tree's build (needs a CUDA GPU)")
    r.add_argument("out", help="file to write (torch.save)")
    r.add_argument("--launch", action="store_true", help="also time a one-element copy kernel")
    r.add_argument("--match", help="only the shapes whose key contains one of these comma-separated texts (e.g. '1024x1024,512x512')")
    c = sub.add_parser("compare", help="the table of two `run` files; exits 1 if any output differs")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        if not torch.cuda.is_available():
            sys.exit("ab_op.py run needs a CUDA GPU")
        run(args.out, args.launch, args.match)
    else:
        table = compare(args.a, args.b)
        print(table)
        if "| NO |" in table:
            sys.exit(1)


if __name__ == "__main__":
    main()
