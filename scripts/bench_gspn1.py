"""gspn2's propagation op against GSPN-1's CUDA op on equal scan work, side by side in one run.

    python scripts/bench_gspn1.py --gspn1-src /path/to/GSPN/ops/gaterecurrent/src --out-dir docs/bench

GSPN-1's op is not part of gspn2: ``--gspn1-src`` names the directory of the public GSPN code
(github.com/NVlabs/GSPN) that holds ``gaterecurrent2dnoind_cuda.cpp`` and ``gaterecurrent2dnoind_kernel.cu``;
they are compiled here at run time with ``torch.utils.cpp_extension.load`` into a build directory outside
the tree, and called through their two functions (``forward``, ``backward``), with the global scan
(``items_each_chunk`` = W: one launch per scan step).

Equal work (docs/spec.md, 4.1): GSPN-1 scans one direction of C channels with per-channel gates; gspn2
scans four directions of C / 4 channels, with per-channel gates (K = C / 4) and with one gate group (K = 1).
Both ops are timed the same way, ``triton.testing.do_bench`` (CUDA events on the current stream, median):
GSPN-1 launches on the default stream, so no CUDA graph. GSPN-1's forward gets a preallocated output and its
backward preallocated, zeroed gradients (its autograd wrapper allocates them; the zeroing is timed, the
allocation is not); gspn2 runs its op as users do (``torch.ops.gspn2.propagate`` / ``propagate_backward``,
outputs allocated by the op). gspn2's CUDA-graph time is shown beside it. Writes ``bench_gspn1.json`` and
``bench_gspn1.md`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

import torch

GSPN1_SOURCES = ("gaterecurrent2dnoind_cuda.cpp", "gaterecurrent2dnoind_kernel.cu")
DT = {"fp32": torch.float32, "bf16": torch.bfloat16}

# (GSPN-1's B, C, H, W; dtype); gspn2 runs (B, C / 4, H, W) in four directions
SHAPES = [
    ((16, 8, 1024, 1024), "fp32"),
    ((16, 8, 1024, 1024), "bf16"),
    ((32, 196, 32, 32), "fp32"),
    ((1, 32, 128, 128), "fp32"),
]


def gspn2_shapes(B, C, H, W):
    """gspn2's problems of the same scan work as GSPN-1's (B, C, H, W): (B, C / 4, H, W, K), K = C / 4 and 1."""
    if C % 4:
        raise ValueError(f"GSPN-1's channel count must be a multiple of 4 (four gspn2 directions), got {C}")
    c = C // 4
    return [(B, c, H, W, c)] + ([(B, c, H, W, 1)] if c > 1 else [])


def check_sources(path: str) -> list[str]:
    """The GSPN-1 source files under ``path``; a ValueError naming ``--gspn1-src`` if any is missing."""
    if not os.path.isdir(path):
        raise ValueError(f"--gspn1-src: {path!r} is not a directory")
    files = [os.path.join(path, f) for f in GSPN1_SOURCES]
    missing = [f for f in GSPN1_SOURCES if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(f"--gspn1-src: {path!r} lacks {', '.join(missing)} (GSPN's ops/gaterecurrent/src)")
    return files


def build_gspn1(files: list[str], build_dir: str):
    from torch.utils.cpp_extension import load

    os.makedirs(build_dir, exist_ok=True)
    return load(name="gspn1_gaterecurrent", sources=files, build_directory=build_dir, verbose=False)


def median_ms(fn, graph=False) -> float:
    from triton.testing import do_bench, do_bench_cudagraph

    if graph:
        return float(do_bench_cudagraph(fn, rep=50, return_mode="median"))
    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def gspn1_times(ext, B, C, H, W, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x, lam, grad = (torch.randn(B, C, H, W, device="cuda", generator=g).to(dtype) for _ in range(3))
    # gates with |g1| + |g2| + |g3| < 1, as GSPN-1's normalisation gives: the scan stays bounded
    gates = [(torch.rand(B, C, H, W, device="cuda", generator=g) / 3).to(dtype) for _ in range(3)]
    out = torch.zeros_like(x)
    grads = [torch.zeros_like(x) for _ in range(5)]

    def fwd():
        ext.forward(W, x, lam, *gates, out)

    def bwd():
        for t in grads:
            t.zero_()
        ext.backward(W, out, grad, x, lam, *gates, *grads)

    fwd()
    torch.cuda.synchronize()
    return median_ms(fwd), median_ms(bwd)


def gspn2_times(B, C, H, W, K, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, C, H, W, device="cuda", generator=g).to(dtype)
    lam = torch.rand(B, 4, C, H, W, device="cuda", generator=g).to(dtype)
    gates = (2 * torch.randn(B, 4, 3, K, H, W, device="cuda", generator=g)).to(dtype)
    grad_h = torch.randn(B, 4, C, H, W, device="cuda", generator=g).to(dtype)

    def fwd():
        return torch.ops.gspn2.propagate(x, lam, gates, None, "auto", 0)

    h = fwd()

    def bwd():
        return torch.ops.gspn2.propagate_backward(grad_h, x, lam, gates, h, None, "auto", 0)

    return median_ms(fwd), median_ms(bwd), median_ms(fwd, graph=True), median_ms(bwd, graph=True)


def markdown(records, env) -> str:
    lines = [
        f"`{env['command']}`: {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, GSPN-1 from {env['gspn1_src']}.",
        "Times in ms (median; `do_bench`, CUDA events; gspn2's CUDA-graph replay in the last column).",
        "",
        "| GSPN-1 problem (one direction) | dtype | GSPN-1 fwd / bwd | gspn2 problem (four directions) "
        "| gspn2 fwd / bwd | speed-up fwd / bwd | gspn2 fwd / bwd, CUDA graph |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['gspn1']} | {r['dtype']} | {r['gspn1_fwd_ms']:.3g} / {r['gspn1_bwd_ms']:.3g} | {r['gspn2']} "
            f"| {r['fwd_ms']:.3g} / {r['bwd_ms']:.3g} | {r['gspn1_fwd_ms'] / r['fwd_ms']:.1f}x / "
            f"{r['gspn1_bwd_ms'] / r['bwd_ms']:.1f}x | {r['graph_fwd_ms']:.3g} / {r['graph_bwd_ms']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gspn1-src", required=True, help="GSPN's ops/gaterecurrent/src directory")
    ap.add_argument("--out-dir", default="bench_out")
    ap.add_argument("--build-dir", default=None, help="where GSPN-1's extension is built (default: a temp dir)")
    args = ap.parse_args(argv)
    files = check_sources(args.gspn1_src)  # before anything is built or written
    if not torch.cuda.is_available():
        raise SystemExit("bench_gspn1.py needs a CUDA GPU")
    import gspn2  # noqa: F401  (registers the ops)
    from gspn2.ops import _cuda

    if not _cuda.extension_available():
        raise SystemExit("bench_gspn1.py needs gspn2's CUDA extension (scripts/setup_env.sh builds it)")
    ext = build_gspn1(files, args.build_dir or os.path.join(tempfile.gettempdir(), "gspn1_gaterecurrent_build"))
    env = dict(
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
        gspn1_src=os.path.abspath(args.gspn1_src),
        command=" ".join(["python"] + [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
    )
    records = []
    for (B, C, H, W), dt in SHAPES:
        f1, b1 = gspn1_times(ext, B, C, H, W, DT[dt])
        for b, c, h, w, k in gspn2_shapes(B, C, H, W):
            f2, b2, gf2, gb2 = gspn2_times(b, c, h, w, k, DT[dt])
            rec = dict(gspn1=f"{B}x{C}x{H}x{W}", gspn2=f"{b}x{c}x{h}x{w}, K={k}", dtype=dt, gspn1_fwd_ms=f1,
                       gspn1_bwd_ms=b1, fwd_ms=f2, bwd_ms=b2, graph_fwd_ms=gf2, graph_bwd_ms=gb2)
            records.append(rec)
            print(json.dumps(rec), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "bench_gspn1.json"), "w") as f:
        json.dump(dict(env=env, records=records), f, indent=1)
    md = markdown(records, env)
    with open(os.path.join(args.out_dir, "bench_gspn1.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
