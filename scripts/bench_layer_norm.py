"""LayerNorm over channels-last rows on gspn2's shapes: ATen's kernel, gspn2's kernel and Inductor's, against the
memory floor.

    python scripts/bench_layer_norm.py                         # gspn2_tiny's norms at batch 128, 224^2, bf16
    python scripts/bench_layer_norm.py --batch 8 --resolution 1024 --json out/ln_1024.json

For every distinct (rows, C, gelu) of the model's LayerNorms (the stem's two, with GELU after the first;
the downsamplers'; the blocks' two norms and the mixer's on E = 1.5 C; the head's norm is left out), the
forward and the forward + backward of ``y = layer_norm(x)`` (``gelu(layer_norm(x))`` for the stem's first):

* ``aten``: ``F.layer_norm`` (then ``F.gelu``), eager, the option ``layer_norm="aten"``;
* ``gspn2``: :func:`gspn2.ops.layer_norm`, eager (one pass with the GELU);
* ``inductor``: the ATen formulation under ``torch.compile`` (what the compiled models run).

Each is a median of CUDA-graph replays (kernel time, no host), parameters in float32 as in training. The
floor: ``x`` read and ``y`` written once (forward); forward + backward adds ``x``, ``grad_y`` read and
``grad_x`` written, at the copy rate measured in the same run. The last lines are a markdown table with
the time per model step (each shape's time times its calls per step).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import torch
import torch.nn.functional as F

from gspn2.benchmark import copy_bandwidth, cudagraph_ms

VARIANTS = ("aten", "gspn2", "inductor")


def norm_shapes(model: str, batch: int, resolution: int) -> Counter:
    """``(rows, C, gelu) -> calls per forward`` of ``model``'s LayerNorm2d modules and its mixers' norms,
    recorded by a forward on the meta device."""
    import timm

    import gspn2  # noqa: F401
    from gspn2.layers import LayerNorm2d

    with torch.device("meta"):
        net = timm.create_model(model, num_classes=0).eval()
    calls: Counter = Counter()

    def record(x, gelu):
        if x.dim() == 4 and x.shape[2] * x.shape[3] > 1:  # the head's norm on pooled features: left out
            calls[(x.shape[0] * x.shape[2] * x.shape[3], x.shape[1], gelu)] += 1

    for m in net.modules():
        if isinstance(m, LayerNorm2d) and m is not net.stem[1]:
            m.register_forward_hook(lambda module, args, out: record(args[0], False))
    # The stem's first norm runs with its GELU (LayerNorm2d.forward_gelu, no module call): its conv's output.
    net.stem[0].register_forward_hook(lambda module, args, out: record(out, True))
    with torch.no_grad():
        net(torch.empty(batch, 3, resolution, resolution, device="meta"))
    return calls


def _fn(variant: str, gelu: bool):
    from gspn2.ops import layer_norm

    def aten(x, w, b):
        y = F.layer_norm(x, x.shape[-1:], w.to(x.dtype), b.to(x.dtype), 1e-6)
        return F.gelu(y) if gelu else y

    if variant == "inductor":
        torch._dynamo.reset()
        return torch.compile(aten, fullgraph=True)
    if variant == "aten":
        return aten
    return lambda x, w, b: layer_norm(x, w, b, 1e-6, gelu)


def time_variant(variant: str, rows: int, C: int, gelu: bool, dtype) -> tuple[float, float]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(rows, C, generator=g, device="cuda") * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.randn(C, generator=g, device="cuda") * 0.2 + 1).requires_grad_()
    b = (torch.randn(C, generator=g, device="cuda") * 0.2).requires_grad_()
    gy = torch.randn(rows, C, generator=g, device="cuda").to(dtype)
    fn = _fn(variant, gelu)

    def fwd():
        with torch.no_grad():
            fn(x, w, b)

    def fwd_bwd():
        torch.autograd.grad(fn(x, w, b), (x, w, b), gy)

    fwd()
    fwd_bwd()
    return cudagraph_ms(fwd), cudagraph_ms(fwd_bwd)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gspn2_tiny")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--resolution", type=int, default=224)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.batch < 1 or args.resolution < 32:
        p.error(f"--batch must be >= 1 and --resolution >= 32, got {args.batch}, {args.resolution}")
    import timm

    import gspn2  # noqa: F401

    if not timm.is_model(args.model) or not args.model.startswith("gspn2"):
        p.error(f"--model must be a gspn2 model, got {args.model!r}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_layer_norm.py needs a CUDA GPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    esize = torch.empty(0, dtype=dtype).element_size()
    shapes = norm_shapes(args.model, args.batch, args.resolution)
    rate = copy_bandwidth()
    print(f"copy rate {rate / 1e12:.2f} TB/s; {args.model} batch {args.batch} at {args.resolution}^2, {args.dtype}",
          flush=True)
    results = []
    for (rows, C, gelu), calls in sorted(shapes.items(), key=lambda kv: -kv[0][0] * kv[0][1]):
        nbytes = rows * C * esize
        row = dict(rows=rows, C=C, gelu=gelu, calls=calls, floor_fwd_ms=2 * nbytes / rate * 1e3,
                   floor_fwd_bwd_ms=5 * nbytes / rate * 1e3)
        for v in args.variants:
            row[v] = time_variant(v, rows, C, gelu, dtype)
            print(f"  {rows} x {C}{' +gelu' if gelu else ''} (x{calls}) {v}: fwd {row[v][0]:.4f} ms, "
                  f"fwd+bwd {row[v][1]:.4f} ms", flush=True)
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, batch=args.batch, resolution=args.resolution, dtype=args.dtype,
                           copy_tbps=rate / 1e12, torch=torch.__version__, results=results), f, indent=1)
    head = " | ".join(f"{v} fwd / fwd+bwd" for v in args.variants)
    print(f"\n| rows × C | calls | floor fwd / fwd+bwd | {head} |")
    print("|---|---|---|" + "---|" * len(args.variants))
    total = Counter()
    for r in results:
        cells = " | ".join(f"{r[v][0]:.4f} / {r[v][1]:.4f}" for v in args.variants)
        print(f"| {r['rows']} × {r['C']}{' + GELU' if r['gelu'] else ''} | {r['calls']} | "
              f"{r['floor_fwd_ms']:.4f} / {r['floor_fwd_bwd_ms']:.4f} | {cells} |")
        total["floor_f"] += r["calls"] * r["floor_fwd_ms"]
        total["floor_fb"] += r["calls"] * r["floor_fwd_bwd_ms"]
        for v in args.variants:
            total[v + "_f"] += r["calls"] * r[v][0]
            total[v + "_fb"] += r["calls"] * r[v][1]
    cells = " | ".join(f"{total[v + '_f']:.3f} / {total[v + '_fb']:.3f}" for v in args.variants)
    print(f"| per step (ms) | | {total['floor_f']:.3f} / {total['floor_fb']:.3f} | {cells} |")


if __name__ == "__main__":
    main(sys.argv[1:])
