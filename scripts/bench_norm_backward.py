"""The mixer's gated norm and out_proj, ``out_proj(layer_norm(y) * silu(z))``, forward + backward under
``torch.compile`` with its backward as Inductor's fusion of the separate ops or as ``gspn2.ops.norm_gate_backward``,
on gspn2_tiny's shapes.

    python scripts/bench_norm_backward.py                 # the four stages of gspn2_tiny at batch 128, bf16
    python scripts/bench_norm_backward.py --sweep         # also the op's kernel alone, over launch configs
    python scripts/bench_norm_backward.py --json out/norm_backward.json

Per stage (N = batch x side^2 rows, E = 1.5 C hidden channels, C outputs), ``norm_linear(y, ..., gate=z)``
(what ``GSPN2Mixer.forward_fused`` runs after proj_up) compiled three ways, each its own compilation:

* ``separate``: the option ``norm_backward="separate"``, Inductor's defaults (it fuses the norm's backward, the
  gate's and the column sums of the norm's parameters into "mix-order" reduction kernels);
* ``separate, no mix-order``: the same with ``torch._inductor.config.triton.mix_order_reduction = False``;
* ``fused``: ``norm_backward="fused"``, the op between the two GEMMs of the backward.

Times are medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``), bf16 autocast with float32
parameters as in training. The op's kernel alone is also timed against its floor: ``grad``, ``y``, ``z`` read
and ``grad_y``, ``grad_z``, the gated rows written once, at the device's copy rate measured in the same run.
The last lines are a markdown table.
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from gspn2.benchmark import copy_bandwidth, cudagraph_ms, fused_op_args, fwd_and_fwd_bwd_ms, selected_stages

VARIANTS = ("separate", "separate, no mix-order", "fused")


def _inputs(N: int, E: int, C: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape, scale=1.0, shift=0.0, dt=torch.float32):
        return (torch.randn(*shape, generator=g, device="cuda") * scale + shift).to(dt).requires_grad_()

    return [r(N, E, scale=2.0, dt=dtype), r(N, E, dt=dtype), r(E, scale=0.1, shift=1.0), r(E, scale=0.1),
            r(C, E, scale=E**-0.5), r(C)]


def _chain(y, z, nw, nb, w, b):
    from gspn2.layers import norm_linear

    return norm_linear(y, nw, nb, 1e-6, w, b, chunks=1, gate=z)[0]


def _compiled_ms(variant: str, leaves, dtype) -> tuple[float, float]:
    import torch._inductor.config as inductor_config

    from gspn2.ops import options

    torch._dynamo.reset()  # the option is read when the backward is traced: one compilation per variant
    with options.override(norm_backward="fused" if variant == "fused" else "separate"), \
            inductor_config.patch({"triton.mix_order_reduction": variant != "separate, no mix-order"}):
        fn = torch.compile(_chain, fullgraph=True)
        return fwd_and_fwd_bwd_ms(lambda: fn(*leaves), leaves, dtype)


def _op_ms(leaves, cfg: dict, programs: int) -> float:
    """The op alone (its kernel and the host-side sums of the partials) with ``cfg`` over ``programs``."""
    from gspn2.ops.norm_backward import triton_backward

    y, z, nw, nb = (t.detach() for t in leaves[:4])
    var, mean = torch.var_mean(y.float(), dim=-1, correction=0)
    rstd = torch.rsqrt(var + 1e-6)
    grad = torch.randn_like(y)
    return cudagraph_ms(lambda: triton_backward(grad, y, z, mean, rstd, nw, nb, cfg, programs))


def main(argv=None) -> None:
    args = fused_op_args("bench_norm_backward.py", __doc__, argv)
    import gspn2  # noqa: F401  (registers the ops)
    from gspn2.ops import _norm_triton as K

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth = copy_bandwidth()
    rows, sweep = [], []
    for side, C in selected_stages(args.sides):
        N, E = args.batch * side * side, int(round(1.5 * C))
        leaves = _inputs(N, E, C, dtype)
        times = {v: _compiled_ms(v, leaves, dtype) for v in VARIANTS}
        cfg = K.config(E)
        op = _op_ms(leaves, cfg, cfg["per_sm"] * sms)
        floor = 6 * N * E * leaves[0].element_size() / bandwidth * 1e3
        rows.append(dict(side=side, N=N, E=E, C=C, op_ms=op, floor_ms=floor, **times))
        print(f"{side}^2 N={N} E={E}: " + ", ".join(f"{v} {t[0]:.4f} / {t[1]:.4f}" for v, t in times.items())
              + f" ms; op {op:.4f} ms (floor {floor:.4f})", flush=True)
        if args.sweep:
            for scale, warps, stages, per_sm in itertools.product((0.5, 1, 2, 4), (4, 8), (1, 2), (4, 8, 16)):
                block_m = int(cfg["block_m"] * scale)
                if block_m < 1 or block_m * cfg["block_e"] < 32 * warps:
                    continue
                c = dict(cfg, block_m=block_m, num_warps=warps, num_stages=stages)
                t = _op_ms(leaves, c, per_sm * sms)
                sweep.append(dict(side=side, block_m=block_m, num_warps=warps, num_stages=stages, per_sm=per_sm, ms=t))
                print(f"  {block_m} rows, {warps} warps, {stages} stages, {per_sm} programs/SM: {t:.4f} ms", flush=True)
        del leaves
    if args.json:
        env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, batch=args.batch, dtype=args.dtype,
                   copy_tbps=bandwidth / 1e12)
        with open(args.json, "w") as f:
            json.dump(dict(env=env, rows=rows, sweep=sweep), f, indent=1)
    print(f"\ncopy rate {bandwidth / 1e12:.2f} TB/s")
    print("| stage | N x E | " + " | ".join(f"{v}: fwd / fwd+bwd ms" for v in VARIANTS)
          + " | fused / separate (fwd+bwd) | op alone / floor ms |")
    print("|---|---|" + "---|" * (len(VARIANTS) + 2))
    for r in rows:
        cells = " | ".join(f"{r[v][0]:.4f} / {r[v][1]:.4f}" for v in VARIANTS)
        print(f"| {r['side']}^2 | {r['N']} x {r['E']} | {cells} | {r['fused'][1] / r['separate'][1]:.2f} | "
              f"{r['op_ms']:.4f} / {r['floor_ms']:.4f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
